"""Launch-config tables: file naming, nearest-token lookup, the default and its one warning (CPU only)."""

from __future__ import annotations

import logging
import re

import msgspec
import pytest
import torch

from epdraft.errors import ConfigError
from epdraft.kernels.experts import tables
from epdraft.kernels.experts.tables import DownConfig, MoeKernelConfig, UpConfig


def cfg(block_m: int) -> MoeKernelConfig:
    return MoeKernelConfig(
        block_m=block_m,
        up=UpConfig(block_n=64, block_k=128, num_warps=4, num_stages=3),
        down=DownConfig(block_n=128, block_k=64, num_warps=8, num_stages=4, split_k=2),
    )


@pytest.fixture(autouse=True)
def fresh_cache():
    tables.load_table.cache_clear()
    yield
    tables.load_table.cache_clear()


def test_file_name():
    name = tables.config_file_name(8, 3072, 4096, torch.bfloat16, "NVIDIA H200")
    assert name == "E=8,N=3072,K=4096,dtype=bf16,device=NVIDIA_H200.json"
    with pytest.raises(ConfigError, match="bf16 and fp16"):
        tables.config_file_name(8, 3072, 4096, torch.float32, "NVIDIA H200")


def test_nearest_token_count(tmp_path):
    path = tmp_path / tables.config_file_name(8, 64, 32, torch.float16, "Dev X")
    tables.save_table({16: cfg(16), 128: cfg(32), 2048: cfg(64)}, path)
    lookup = lambda t: tables.get_config(8, 64, 32, torch.float16, t, 1, "Dev X", tmp_path).block_m  # noqa: E731
    assert [lookup(t) for t in (1, 16, 71, 72, 73, 1000, 1088, 1089, 10**6)] == [16, 16, 16, 16, 32, 32, 32, 64, 64]
    assert tables.get_config(8, 64, 32, torch.float16, 128, 1, "Dev X", tmp_path) == cfg(32)
    # keyed by rows M = T * top_k: 64 tokens at top-2 are the 128-row entry
    assert tables.get_config(8, 64, 32, torch.float16, 64, 2, "Dev X", tmp_path) == cfg(32)


def test_saved_table_round_trips_and_merges(tmp_path):
    path = tmp_path / "t.json"
    tables.save_table({512: cfg(64), 16: cfg(16)}, path)
    raw = msgspec.json.decode(path.read_bytes())
    assert list(raw) == ["16", "512"]
    assert raw["512"]["down"]["split_k"] == 2
    assert tables.load_table(path) == {16: cfg(16), 512: cfg(64)}
    tables.save_table({512: cfg(128), 32: cfg(32)}, path)
    assert tables.load_table(path) == {16: cfg(16), 32: cfg(32), 512: cfg(128)}


def test_missing_file_warns_once_and_uses_default(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="epdraft.kernels.experts.tables"):
        first = tables.get_config(8, 3072, 4096, torch.bfloat16, 16, 1, "Dev Y", tmp_path)
        second = tables.get_config(8, 3072, 4096, torch.bfloat16, 2048, 1, "Dev Y", tmp_path)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "E=8,N=3072,K=4096,dtype=bf16,device=Dev_Y.json" in warnings[0].getMessage()
    assert first == tables.default_config(16, 1, 8)
    assert second == tables.default_config(2048, 1, 8)


def test_default_block_rows_follow_rows_per_expert():
    assert tables.default_config(16, 1, 8).block_m == 16
    assert tables.default_config(512, 1, 8).block_m == 32
    assert tables.default_config(2048, 2, 8).block_m == 64
    assert tables.default_config(2048, 10, 512).block_m == 32


def test_malformed_tables_name_the_file(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json: not valid JSON"):
        tables.load_table(bad_json)
    bad_value = tmp_path / "value.json"
    tiles = '{"block_n": 64, "block_k": 64}'
    bad_value.write_text(f'{{"16": {{"block_m": 8, "up": {tiles}, "down": {tiles}}}}}')
    with pytest.raises(ConfigError, match=r"value.json: .*block_m"):
        tables.load_table(bad_value)
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    with pytest.raises(ConfigError, match="empty table"):
        tables.load_table(empty)


def test_old_tables_read_with_defaults():
    """Tables written before split-K up GEMMs and program orders still load: split_k 1, group_m 0."""
    raw = b'{"16": {"block_m": 16, "up": {"block_n": 64, "block_k": 128}, "down": {"block_n": 64, "block_k": 64}}}'
    table = msgspec.json.decode(raw, type=dict[int, MoeKernelConfig])
    assert table[16].up.split_k == 1 and table[16].up.group_m == 0 and table[16].down.group_m == 0
    assert not table[16].up.weight_tma and not table[16].down.weight_tma


def test_quantized_tables_are_their_own_and_fall_back_to_the_bf16_table(tmp_path, caplog):
    name = tables.config_file_name(8, 3072, 4096, torch.bfloat16, "NVIDIA H200", "mxfp4")
    assert name == "E=8,N=3072,K=4096,dtype=bf16,weights=mxfp4,device=NVIDIA_H200.json"
    tables.save_table({16: cfg(16)}, tmp_path / tables.config_file_name(8, 64, 32, torch.bfloat16, "Dev"))
    got = tables.get_config(8, 64, 32, torch.bfloat16, 16, 1, "Dev", tmp_path, weights="fp8")
    assert got == cfg(16)  # no fp8 table: the shape's bf16 tiles (one warning names the missing file)
    assert any("weights=fp8" in r.message for r in caplog.records)
    tables.save_table({16: cfg(32)}, tmp_path / tables.config_file_name(8, 64, 32, torch.bfloat16, "Dev", "fp8"))
    tables.load_table.cache_clear()
    assert tables.get_config(8, 64, 32, torch.bfloat16, 16, 1, "Dev", tmp_path, weights="fp8") == cfg(32)


def test_fit_format_makes_a_config_runnable_for_quantized_weights():
    wide = MoeKernelConfig(block_m=16, up=UpConfig(block_n=32, block_k=256, split_k=4),
                           down=DownConfig(block_n=64, block_k=128, split_k=1))
    fp8 = tables.fit_format(wide, "fp8", 128, hidden=4096, intermediate=1536)
    assert (fp8.up.block_k, fp8.up.split_k, fp8.down.block_k) == (128, 4, 128)  # tiles within one scale block
    mx = tables.fit_format(wide, "mxfp4", 32, hidden=5120, intermediate=512)
    assert mx.up.block_k * mx.up.split_k <= 5120 and 5120 % (mx.up.block_k * mx.up.split_k) == 0
    assert tables.fit_format(wide, "bf16", 1, 100, 100) == wide
    with pytest.raises(ConfigError, match="not a multiple of 64"):
        tables.fit_format(wide, "mxfp4", 32, hidden=4096, intermediate=96)


def test_a_quantized_table_serves_up_to_twice_its_largest_rows_then_the_bf16_table(tmp_path, caplog):
    tables.save_table({16: cfg(16), 2048: cfg(128)}, tmp_path / tables.config_file_name(8, 64, 32, torch.bfloat16, "Dev"))
    tables.save_table({48: cfg(32), 1536: cfg(64)},
                      tmp_path / tables.config_file_name(8, 64, 32, torch.bfloat16, "Dev", "mxfp4"))  # fmt: skip
    lookup = lambda t: tables.get_config(8, 64, 32, torch.bfloat16, t, 3, "Dev", tmp_path, weights="mxfp4")  # noqa: E731
    assert lookup(16) == cfg(32) and lookup(512) == cfg(64)
    assert lookup(1024) == cfg(64)  # M = 3072: twice the table's 1536, still its own
    assert lookup(2048) == cfg(128)  # M = 6144: the bf16 table's nearest entry
    assert not caplog.records  # both tables exist: nothing to warn about
    assert tables.get_config(8, 64, 32, torch.bfloat16, 16, 1, "Dev", tmp_path / "none", weights="fp8") == (
        tables.default_config(16, 1, 8)
    )
    assert any("weights=fp8" in r.getMessage() and "the default config" in r.getMessage() for r in caplog.records)


_SHIPPED_NAME = re.compile(r"E=(\d+),N=(\d+),K=(\d+),dtype=(bf16|fp16)(?:,weights=(fp8|mxfp4))?,device=(\w+)\.json")


@pytest.mark.parametrize("path", sorted(tables.CONFIG_DIR.glob("*.json")), ids=lambda p: p.name)
def test_shipped_tables_load_under_their_own_name_and_run_in_their_format(path):
    """Every table the package ships (tuned on a GPU, some rebuilt from a tuner's log by hand) parses,
    is named as `config_file_name` names what it serves, and holds configs its weight format's
    kernels can run: whole K tiles of H for the up GEMM and of I (N / 2) for the down."""
    match = _SHIPPED_NAME.fullmatch(path.name)
    assert match, f"{path.name}: not a name config_file_name writes"
    e, n, k, dtype, weights, device = match.groups()
    weights = weights or "bf16"
    dtype_ = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    assert tables.config_file_name(int(e), int(n), int(k), dtype_, device.replace("_", " "), weights) == path.name
    table = tables.load_table(path)
    assert table and all(rows > 0 for rows in table)
    for config in table.values():
        assert config.block_m in (16, 32, 64, 128)
        assert tables.fits_format(config.up, weights, int(k)), (path.name, config.up)
        assert tables.fits_format(config.down, weights, int(n) // 2), (path.name, config.down)
