"""ExpertShard: which experts and which intermediate slice one rank holds, in the loader's terms."""

from __future__ import annotations

import dataclasses

from epdraft.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ExpertShard:
    """EP rank r holds global experts [first, first + count); TP rank t holds rows [t*F, (t+1)*F) of I.

    `transposed_interleaved` marks the gpt-oss fused layout (`gate_up_proj [E, H, 2I]` with gate and
    up columns interleaved, `down_proj [E, I, H]`), which shares its tensor names with the HF v5
    layout (`gate_up_proj [E, 2I, H]` gate rows first, `down_proj [E, H, I]`); only the model family
    tells them apart when H == 2I.
    """

    num_experts: int
    intermediate_size: int
    hidden_size: int
    ep_rank: int = 0
    ep_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    transposed_interleaved: bool = False
    layer_id: int | None = None

    def __post_init__(self) -> None:
        where = f"layer {self.layer_id}" if self.layer_id is not None else "MoE layer"
        if self.num_experts % self.ep_size:
            raise ConfigError(f"{where}: {self.num_experts} experts do not divide over draft.moe_ep = {self.ep_size}")
        if self.intermediate_size % self.tp_size:
            raise ConfigError(
                f"{where}: expert intermediate size {self.intermediate_size} "
                f"does not divide over draft.moe_tp = {self.tp_size}"
            )
        if not (0 <= self.ep_rank < self.ep_size and 0 <= self.tp_rank < self.tp_size):
            raise ConfigError(
                f"{where}: rank out of range: ep {self.ep_rank} of {self.ep_size}, tp {self.tp_rank} of {self.tp_size}"
            )

    @property
    def count(self) -> int:
        """e: experts held here."""
        return self.num_experts // self.ep_size

    @property
    def first(self) -> int:
        return self.ep_rank * self.count

    @property
    def slice_size(self) -> int:
        """F: intermediate rows of each held expert."""
        return self.intermediate_size // self.tp_size

    @property
    def slice_start(self) -> int:
        return self.tp_rank * self.slice_size

    def holds(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.count
