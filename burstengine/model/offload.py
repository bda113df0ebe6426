"""Keeping a layer's saved activations in host memory between its forward and its backward.

The ``offload`` checkpointing policy runs a layer as ``pointwise`` does (every matmul's output and
the attention output kept, only the pointwise ops recomputed) and keeps what autograd saves in
pinned host memory instead of on the device:

* forward: each tensor the layer saves for backward (autograd's saved-tensor hooks) whose storage
  holds at least :data:`MIN_BYTES`, and is not a parameter or another input the caller names
  (RoPE's cos/sin, shared by every layer), is copied whole storage, once per storage, into host
  memory on a side stream.  The device storages are released when the layer's forward ends:
  ``record_stream`` makes the caching allocator wait for the copies before it reuses the memory,
  so the copies overlap the next layers' compute.  The host waits, at the end of each offloaded
  layer's forward, for the previous one's copies (done by then on the device): otherwise it runs
  layers ahead, and their allocations cannot reuse the blocks still being copied.
* backward: the layer's tensors come back on the same side stream.  :meth:`Offloader.follow`
  (the model calls it on the output of the layer above) starts the copy when the backward reaches
  that layer, so it overlaps that layer's backward; the layer's first unpacked tensor makes the
  compute stream wait for the copy (a device-side wait).  Without a layer above (the last layer,
  or a block run alone) the copy starts at the first unpack and is exposed.

Host memory: each layer index reuses its page-locked buffers from step to step (allocated at
their exact sizes on the first step, ``cudaHostRegister``; torch's pinned allocator would round
each up to a power of two).  Buffers are taken by a layer's forward and given back when the
autograd graph holding them is freed, so two graphs alive at once (two forwards before one
backward) get separate buffers, never one another's.  ``retain_graph=True`` keeps the restored
tensors on the device until the graph is freed.  On a CPU device the "host" copy is a plain copy
(what the tests exercise: the bookkeeping, not the overlap).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch

MIN_BYTES = 1 << 20  # smaller storages (norm statistics, short lse) stay on the device


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _bytes_of(storage, device) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class _HostBuffer:
    """One page-locked host buffer of exactly ``nbytes`` (registered with CUDA when it is there)."""

    def __init__(self, nbytes: int, pin: bool):
        self.data = torch.empty(nbytes, dtype=torch.uint8)
        self.registered = False
        if pin and nbytes:
            err = int(torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), nbytes, 0))
            if err:
                raise RuntimeError(f"offload: cudaHostRegister of {nbytes / 2**30:.2f} GiB of host memory failed "
                                   f"(cudaError {err}); lower offload_memory_gib or turn activation_offload off")
            self.registered = True

    def release(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())
            self.registered = False

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown: CUDA may be gone already
            pass


_PLAIN = (torch.Tensor, torch.nn.Parameter)


class _Stash:
    """What one forward of one offloaded layer saved: host copies of its storages, and (from the
    prefetch until the graph lets go) their device copies."""

    def __init__(self, owner: "Offloader", index: int, skip: set[int]):
        self.owner, self.index, self.skip = owner, index, skip
        self.buffers = owner._take(index)  # reused by position, step after step
        self.used = 0
        self.host: dict[int, torch.Tensor] = {}  # storage key -> host bytes
        # the storages copied so far, alive until the layer's forward ends: a key names one
        # storage only while it lives (a freed block's address comes back for the next tensor)
        self.alive: list = []
        self.device_copy: dict = {}  # storage key -> device storage
        self.ready = None  # event: the device copies are complete (CUDA)
        self.waited = False
        weakref.finalize(self, owner._give, index, self.buffers)

    def _host_bytes(self, nbytes: int) -> torch.Tensor:
        if self.used == len(self.buffers):
            self.buffers.append(_HostBuffer(nbytes, self.owner.cuda))
        elif self.buffers[self.used].data.numel() < nbytes:  # shapes grew: replace it
            self.owner.sync()
            self.buffers[self.used].release()
            self.buffers[self.used] = _HostBuffer(nbytes, self.owner.cuda)
        buf = self.buffers[self.used].data[:nbytes]
        self.used += 1
        return buf

    def pack(self, t: torch.Tensor):
        # a tensor subclass (torch-native CP's DTensors) has no storage of its own to copy: it
        # stays on the device
        if t.device.type != self.owner.device.type or type(t) not in _PLAIN:
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.skip or storage.nbytes() < MIN_BYTES:
            return t
        if key not in self.host:
            src = _bytes_of(storage, t.device)
            dst = self._host_bytes(storage.nbytes())
            o = self.owner
            if o.cuda:
                o.side.wait_stream(torch.cuda.current_stream(t.device))  # the tensor is written there
                with torch.cuda.stream(o.side):
                    dst.copy_(src, non_blocking=True)
                src.record_stream(o.side)  # the allocator reuses the block only after the copy
            else:
                dst.copy_(src)
            self.host[key] = dst
            self.alive.append(storage)
        return _Saved(self, key, t.dtype, tuple(t.shape), t.stride(), t.storage_offset())

    def fetch(self) -> None:
        """Start copying every storage back to the device (allocated on the compute stream)."""
        if self.device_copy:
            return
        o = self.owner
        for key, host in self.host.items():
            dev = torch.empty(host.numel(), dtype=torch.uint8, device=o.device)
            self.device_copy[key] = dev
        if o.cuda:
            compute = torch.cuda.current_stream(o.device)
            o.side.wait_stream(compute)  # the blocks may have been freed by compute work still queued
            with torch.cuda.stream(o.side):
                for key, host in self.host.items():
                    self.device_copy[key].copy_(host, non_blocking=True)
                    self.device_copy[key].record_stream(o.side)
                self.ready = torch.cuda.Event()
                self.ready.record(o.side)
        else:
            for key, host in self.host.items():
                self.device_copy[key].copy_(host)
        self.device_copy = {k: v.untyped_storage() for k, v in self.device_copy.items()}
        self.waited = False

    def unpack(self, saved: "_Saved") -> torch.Tensor:
        if not self.device_copy:
            self.fetch()
        if self.ready is not None and not self.waited:
            torch.cuda.current_stream(self.owner.device).wait_event(self.ready)
            self.waited = True
        out = torch.empty(0, dtype=saved.dtype, device=self.owner.device)
        return out.set_(self.device_copy[saved.key], saved.offset, saved.shape, saved.stride)


class _Saved:
    __slots__ = ("stash", "key", "dtype", "shape", "stride", "offset")

    def __init__(self, stash, key, dtype, shape, stride, offset):
        self.stash, self.key, self.dtype, self.shape, self.stride, self.offset = stash, key, dtype, shape, stride, offset


def _unpack(x):
    return x.stash.unpack(x) if isinstance(x, _Saved) else x


class Offloader:
    """The side stream and the host buffers of one model's offloaded layers on ``device``."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self._free: dict[int, list[list[_HostBuffer]]] = {}
        self._last = None  # weak reference to the newest stash whose prefetch no layer above has claimed
        self._copying = None  # event: the newest offloaded layer's copies to the host are done

    def _take(self, index: int) -> list:
        free = self._free.get(index)
        return free.pop() if free else []

    def _give(self, index: int, buffers: list) -> None:
        # a later copy into these buffers is queued on the same side stream as the last copy out of them
        self._free.setdefault(index, []).append(buffers)

    def sync(self) -> None:
        if self.cuda:
            self.side.synchronize()

    def host_bytes(self) -> int:
        """Bytes of host buffers this offloader holds (free ones included)."""
        return sum(b.data.numel() for sets in self._free.values() for s in sets for b in s)

    @contextmanager
    def layer(self, index: int, keep=()):
        """Run one layer's forward with its saved activations going to host memory.  ``keep``:
        tensors to leave on the device (parameters, inputs shared with other layers)."""
        skip = {_storage_key(t) for t in keep if isinstance(t, torch.Tensor)}
        stash = _Stash(self, index, skip)
        with torch.autograd.graph.saved_tensors_hooks(stash.pack, _unpack):
            yield
        stash.alive.clear()  # now the copies' blocks return to the allocator (after the copies)
        if self.cuda and stash.host:
            # the host runs layers ahead of the device, and a block waiting on a copy cannot be
            # reused: without a brake the layers ahead take fresh memory until the allocator
            # runs out and frees its cache (a device-wide stall).  Wait here for the previous
            # offloaded layer's copies, which the device finishes during this layer's forward.
            done = torch.cuda.Event()
            done.record(self.side)
            if self._copying is not None:
                self._copying.synchronize()
            self._copying = done
        self._last = weakref.ref(stash) if stash.host else None

    def newest(self):
        """The newest offloaded layer's stash (a weak reference) that no layer above has claimed
        yet, or None; claims it."""
        ref, self._last = self._last, None
        return ref

    @staticmethod
    def follow(ref, h: torch.Tensor) -> None:
        """``h``: the output of the layer above the one ``ref`` (from :meth:`newest`) names.  Its
        gradient is ready when the backward reaches that layer: then start copying back."""
        if ref is None or not h.requires_grad:
            return

        def prefetch(grad):
            stash = ref()
            if stash is not None:
                stash.fetch()

        h.register_hook(prefetch)

    def __deepcopy__(self, memo):  # a copied model gets its own stream and buffers
        return Offloader(self.device)

    def release(self) -> None:
        """Give the free host buffers back to the system."""
        self.sync()
        for sets in self._free.values():
            for s in sets:
                for b in s:
                    b.release()
        self._free.clear()
