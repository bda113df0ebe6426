"""BurstEngine training: config, mesh + FSDP2, data, loop, checkpoints, metrics."""
from .config import PRESETS, TrainConfig, load
from .loop import Trainer

__all__ = ["TrainConfig", "PRESETS", "load", "Trainer"]
