"""SHA-256 of files: what checkpoints and the token cache record at write and check on read."""
from __future__ import annotations

import hashlib


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
