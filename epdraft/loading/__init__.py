"""safetensors -> FFN modules: every export naming, EP/TP-sharded reads, quantized formats, strict checks."""

from epdraft.loading.ffn import check_ffn_loaded, load_ffn, load_into
from epdraft.loading.quantized import QuantizedSource, quantized_source
from epdraft.loading.shard import ExpertShard
from epdraft.loading.source import (
    DictSource,
    HeaderSource,
    SafetensorsSource,
    TensorSource,
    as_source,
    checkpoint_weight_map,
    open_checkpoint,
)

__all__ = [
    "DictSource",
    "ExpertShard",
    "HeaderSource",
    "QuantizedSource",
    "SafetensorsSource",
    "TensorSource",
    "as_source",
    "checkpoint_weight_map",
    "check_ffn_loaded",
    "load_ffn",
    "load_into",
    "open_checkpoint",
    "quantized_source",
]
