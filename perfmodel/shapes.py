"""Model shapes: what the performance model needs to know about a network.

A `ModelShape` is the static description of a model (size and transformer
dimensions).  It is hashable and has a stable `key` used to cache fitted
parameters and sensitivity curves.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Static shape of a model.

    params_m:   parameter count in millions.
    layers:     transformer layers (encoder + decoder for seq2seq).
    hidden:     hidden size.
    seq_len:    tokens (or patches) per sample.
    heads:      attention heads (0 = unknown; then TP degree is not restricted
                by head divisibility and attention-score memory is estimated
                with hidden/64 heads).
    kv_heads:   key/value heads (grouped-query attention; 0 = as many as ``heads``):
                a TP degree must divide them too (each rank holds whole k/v heads).
    grad_bytes: bytes per gradient element on the wire during data-parallel
                sync (2 for fp16/bf16 grads as in Megatron/DeepSpeed, 4 for
                HF-Trainer AMP which keeps fp32 master grads).
    """

    name: str
    params_m: float
    layers: int
    hidden: int
    seq_len: int
    heads: int = 0
    grad_bytes: int = 2
    kv_heads: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ModelShape.name must be non-empty")
        if not (self.params_m > 0):
            raise ValueError(f"params_m must be > 0, got {self.params_m}")
        for field in ("layers", "hidden", "seq_len"):
            if int(getattr(self, field)) <= 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")
        if self.heads < 0:
            raise ValueError(f"heads must be >= 0, got {self.heads}")
        if self.kv_heads < 0 or (self.kv_heads and self.heads and (self.kv_heads > self.heads or self.heads % self.kv_heads)):
            raise ValueError(f"kv_heads must be >= 0 and divide heads ({self.heads}), got {self.kv_heads}")
        if self.grad_bytes not in (2, 4):
            raise ValueError(f"grad_bytes must be 2 or 4, got {self.grad_bytes}")

    @property
    def key(self) -> str:
        """Stable cache key: same key <=> same shape."""
        return (
            f"{self.name}:p{self.params_m:.3f}m:l{self.layers}:h{self.hidden}"
            f":s{self.seq_len}:a{self.heads}:g{self.grad_bytes}"
            + (f":k{self.kv_heads}" if self.kv_heads else "")  # keys of shapes without it unchanged
        )

    @property
    def n_heads(self) -> int:
        return self.heads if self.heads > 0 else max(1, self.hidden // 64)

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.n_heads

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "params_m": self.params_m,
            "layers": self.layers,
            "hidden": self.hidden,
            "seq_len": self.seq_len,
            "heads": self.heads,
            "grad_bytes": self.grad_bytes,
            **({"kv_heads": self.kv_heads} if self.kv_heads else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "ModelShape":
        return cls(
            name=str(d["name"]),
            params_m=float(d["params_m"]),
            layers=int(d["layers"]),
            hidden=int(d["hidden"]),
            seq_len=int(d["seq_len"]),
            heads=int(d.get("heads", 0)),
            grad_bytes=int(d.get("grad_bytes", 2)),
            kv_heads=int(d.get("kv_heads", 0)),
        )
