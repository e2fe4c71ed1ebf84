"""HFHeads: the embedding and lm_head read from safetensors equal HFTarget's, tied or not, sharded or not."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from epdraft.errors import LoadError
from epdraft.target.heads import HFHeads
from epdraft.target.hf import HFTarget

transformers = pytest.importorskip("transformers")

TINY_TARGET = Path(__file__).resolve().parents[2] / "epdraft" / "assets" / "tiny-target"


def _assert_same_heads(heads: HFHeads, target: HFTarget) -> None:
    assert (heads.hidden_size, heads.vocab_size, heads.num_layers) == (
        target.hidden_size, target.vocab_size, target.num_layers
    )
    ids = torch.arange(target.vocab_size).view(2, -1)
    assert torch.equal(heads.embed(ids), target.embed(ids))
    hidden = torch.randn(3, 5, target.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(heads.lm_head(hidden), target.lm_head(hidden))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_target_heads_equal_hf_target(dtype):
    heads = HFHeads.from_pretrained(TINY_TARGET, dtype=dtype)
    target = HFTarget.from_pretrained(TINY_TARGET, [0], dtype=dtype)
    assert heads.dtype == dtype and heads.lm_head_weight is heads.embed_weight  # tied: one tensor
    _assert_same_heads(heads, target)


def test_untied_sharded_checkpoint_equals_hf_target(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
    )
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    heads = HFHeads.from_pretrained(tmp_path)
    target = HFTarget.from_pretrained(tmp_path, [0])
    assert not torch.equal(heads.lm_head_weight, heads.embed_weight)
    _assert_same_heads(heads, target)


def _write(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_multimodal_wrapper_names(tmp_path):
    embed, head = torch.randn(10, 4), torch.randn(10, 4)
    config = {"tie_word_embeddings": False,
              "text_config": {"hidden_size": 4, "vocab_size": 10, "num_hidden_layers": 3}}  # fmt: skip
    tensors = {"model.language_model.embed_tokens.weight": embed, "lm_head.weight": head}
    heads = HFHeads.from_pretrained(_write(tmp_path / "mm", config, tensors))
    assert (heads.hidden_size, heads.vocab_size, heads.num_layers) == (4, 10, 3)
    ids = torch.tensor([[3, 9]])
    assert torch.equal(heads.embed(ids), embed[ids])
    hidden = torch.randn(2, 4)
    assert torch.equal(heads.lm_head(hidden), hidden @ head.T)


def test_missing_tensors_are_named(tmp_path):
    config = {"hidden_size": 4, "vocab_size": 10, "num_hidden_layers": 1, "tie_word_embeddings": False}
    with pytest.raises(LoadError, match="lm_head.weight"):
        HFHeads.from_pretrained(_write(tmp_path / "a", config, {"model.embed_tokens.weight": torch.zeros(10, 4)}))
    with pytest.raises(LoadError, match="model.embed_tokens.weight"):
        HFHeads.from_pretrained(_write(tmp_path / "b", config, {"lm_head.weight": torch.zeros(10, 4)}))
    with pytest.raises(LoadError, match=r"model.embed_tokens.weight has shape \[10, 5\]"):
        HFHeads.from_pretrained(_write(tmp_path / "c", config, {"model.embed_tokens.weight": torch.zeros(10, 5)}))
