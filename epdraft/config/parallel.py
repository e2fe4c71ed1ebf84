"""ParallelConfig: how the draft (and the target beside it) is laid out over nodes and ranks.

One file (TOML, YAML or JSON) per deployment, e.g. `configs/h200x8-dp8-ep8.toml`:

    [cluster]                  [draft]                       [target]     [placement]
    nnodes = 1                 attn_dp = 8                   tp = 1       mode = "colocated"
    nproc_per_node = 8         moe_layout = "alltoall"       dp = 8
    device = "cuda"            moe_ep = 8

Everything is checked here, once, at load: later code trusts the Struct. Every error is a
`ConfigError` naming the file, the key path as the user typed it (`draft.moe_ep`), the value and
what was expected. CLI overrides (`--set draft.moe_ep=2`) use the same key paths.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal

import msgspec

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library
    import tomli as tomllib

from epdraft.config.hf import DraftMixFFNSpec
from epdraft.errors import ConfigError

# The all-to-all backends that need CUDA GPUs (and an NCCL group): refused here on a CPU config.
CUDA_A2A_BACKENDS = ("deepep", "mooncake")
# Below a second the rendezvous and process-group init time out on any host; above a day a hang
# would never be reported. `inf` would also overflow the timedelta every rank builds from it.
MIN_TIMEOUT_S = 1.0
MAX_TIMEOUT_S = 86400.0
# A rank's heartbeat thread beats every hang_timeout_s / 10 (at most once a second): below 2 s a
# loaded host's scheduler alone could miss the bound.
MIN_HANG_TIMEOUT_S = 2.0
DEFAULT_HANG_TIMEOUT_S = 20.0
# The configs installed with the package (`configs/` at the repository root links here), so a
# name such as `local-cpu-4` works from any directory.
SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def fixed_row_buffers(a2a_backend: str, low_latency: bool) -> bool:
    """Whether an all-to-all backend sizes its buffers once, for `draft.max_rows_per_rank` rows a
    rank (DeepEP's low-latency kernels, Mooncake EP), so a step may send no more than that.
    DeepEP's normal kernels move any row count through theirs in chunks."""
    return a2a_backend == "mooncake" or (a2a_backend == "deepep" and low_latency)


class ClusterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The machines: `nnodes x nproc_per_node` ranks, one accelerator (or CPU process) each."""

    nnodes: Annotated[int, msgspec.Meta(ge=1, description="number of nodes (hosts)")]
    nproc_per_node: Annotated[int, msgspec.Meta(ge=1, description="ranks per node, one GPU each")]
    device: Literal["cuda", "cpu", "auto"] = "auto"
    backend: Literal["nccl", "gloo", "auto"] = "auto"
    timeout_s: Annotated[
        float, msgspec.Meta(gt=0, description="bound on rendezvous, process-group init and every collective")
    ] = 600.0
    hang_timeout_s: Annotated[
        float,
        msgspec.Meta(
            gt=0,
            description="a rank without a heartbeat this long is named as stalled and every other rank exits; "
            "below timeout_s",
        ),
    ] = DEFAULT_HANG_TIMEOUT_S

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


class DraftConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The draft: data-parallel attention on every draft rank, MoE laid out by `moe_layout`."""

    attn_dp: Annotated[int, msgspec.Meta(ge=1, description="attention DP degree = number of draft ranks")]
    moe_layout: Literal["replicated", "alltoall", "gather", "auto"] = "replicated"
    moe_ep: Annotated[int, msgspec.Meta(ge=1, description="ranks sharing one copy of the experts (by expert)")] = 1
    moe_tp: Annotated[int, msgspec.Meta(ge=1, description="slices of each expert's intermediate dim")] = 1
    a2a_backend: Annotated[
        Literal["torch", "torch_fixed", "deepep", "mooncake"],
        msgspec.Meta(
            description="alltoall transport: torch (exact splits), torch_fixed (one equal-split collective per "
            "direction, no host sync), deepep, mooncake"
        ),
    ] = "torch"
    dp_padding: Literal["max_len", "sum_len"] = "max_len"
    low_latency: Annotated[
        bool, msgspec.Meta(description="deepep only: the fixed-buffer low-latency kernels (no host sync)")
    ] = False
    cuda_graphs: Annotated[
        bool,
        msgspec.Meta(
            description="replay the draft step from CUDA graphs (CUDA; replicated, gather, torch_fixed or deepep "
            "low_latency dispatch)"
        ),
    ] = False
    max_requests: Annotated[
        int, msgspec.Meta(ge=0, description="requests one rank holds at once (KV pool slots); 0 = sized by the run")
    ] = 0
    max_context: Annotated[
        int, msgspec.Meta(ge=0, description="context rows one request may reach (KV pool rows); 0 = sized by the run")
    ] = 0
    max_rows_per_rank: Annotated[
        int,
        msgspec.Meta(
            ge=0, description="rows per rank per step (requests x block size) fixed-buffer backends are sized for"
        ),
    ] = 256

    @property
    def moe_group_size(self) -> int:
        """Ranks holding one full copy of the experts: moe_ep x moe_tp."""
        return self.moe_ep * self.moe_tp

    @property
    def moe_dp(self) -> int:
        """How many full copies of the experts the draft ranks hold."""
        return self.attn_dp // self.moe_group_size


class TargetConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the target runs: the host engine's layout. The standalone runner replicates its HF
    target (tp = 1, dp = the target ranks) and refuses tp > 1 (`check_standalone_target`)."""

    dp: Annotated[int, msgspec.Meta(ge=1, description="target data-parallel degree; tp x dp = target ranks")]
    tp: Annotated[int, msgspec.Meta(ge=1, description="target tensor-parallel degree")] = 1


class PlacementConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Whether the draft shares ranks with the target or has nodes of its own."""

    mode: Literal["colocated", "disaggregated"] = "colocated"
    draft_nodes: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=0)], ...],
        msgspec.Meta(description="node indices holding the draft when disaggregated"),
    ] = ()
    transfer: Literal["torch", "mooncake"] = "torch"


class ParallelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole layout; validated across sections on construction."""

    cluster: ClusterConfig
    draft: DraftConfig
    target: TargetConfig
    placement: PlacementConfig = PlacementConfig()

    def __post_init__(self) -> None:
        _check_cluster(self)
        _check_placement(self)
        _check_draft(self)
        if self.target.tp * self.target.dp != self.target_world_size:
            raise ConfigError(
                f"target.tp x target.dp = {self.target.tp} x {self.target.dp} must equal the target world size "
                f"{self.target_world_size} ({self._describe_ranks(self.target_ranks)})"
            )

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    @property
    def draft_nodes(self) -> tuple[int, ...]:
        """Node indices holding the draft, ascending (every node when colocated)."""
        if self.placement.mode == "colocated":
            return tuple(range(self.cluster.nnodes))
        return tuple(sorted(self.placement.draft_nodes))

    @property
    def draft_ranks(self) -> tuple[int, ...]:
        """Global ranks holding the draft, ascending; the device mesh is laid over them in this order."""
        n = self.cluster.nproc_per_node
        return tuple(node * n + local for node in self.draft_nodes for local in range(n))

    @property
    def target_ranks(self) -> tuple[int, ...]:
        """Global ranks running the target (all of them when colocated)."""
        if self.placement.mode == "colocated":
            return tuple(range(self.world_size))
        draft = set(self.draft_ranks)
        return tuple(r for r in range(self.world_size) if r not in draft)

    @property
    def draft_world_size(self) -> int:
        return len(self.draft_ranks)

    @property
    def target_world_size(self) -> int:
        return len(self.target_ranks)

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain data (what rank 0 logs and saves with the outputs)."""
        return msgspec.to_builtins(self)

    def _describe_ranks(self, ranks: tuple[int, ...]) -> str:
        nodes = len(ranks) // self.cluster.nproc_per_node
        return f"{nodes} node(s) x cluster.nproc_per_node = {self.cluster.nproc_per_node}"


def _check_cluster(pc: ParallelConfig) -> None:
    c = pc.cluster
    if not MIN_TIMEOUT_S <= c.timeout_s <= MAX_TIMEOUT_S:
        raise ConfigError(
            f"cluster.timeout_s = {c.timeout_s:g}: expected seconds in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}] "
            "(it bounds the rendezvous, process-group init and every collective)"
        )
    if not MIN_HANG_TIMEOUT_S <= c.hang_timeout_s < c.timeout_s:
        raise ConfigError(
            f"cluster.hang_timeout_s = {c.hang_timeout_s:g}: expected seconds in [{MIN_HANG_TIMEOUT_S:g}, "
            f"cluster.timeout_s = {c.timeout_s:g}) (a stalled rank must be named before the collectives waiting "
            f"on it time out), e.g. --set cluster.hang_timeout_s={max(MIN_HANG_TIMEOUT_S, c.timeout_s / 4):g}"
        )
    if c.device == "cpu" and c.backend == "nccl":
        raise ConfigError("cluster.backend = 'nccl' needs CUDA but cluster.device = 'cpu'; use 'gloo' or 'auto'")
    if c.device == "cpu" and pc.draft.a2a_backend in CUDA_A2A_BACKENDS:
        raise ConfigError(
            f"draft.a2a_backend = {pc.draft.a2a_backend!r} needs CUDA but cluster.device = 'cpu'; use 'torch'"
        )


def _check_placement(pc: ParallelConfig) -> None:
    p = pc.placement
    if p.mode == "colocated":
        if p.draft_nodes:
            raise ConfigError(
                f"placement.draft_nodes = {list(p.draft_nodes)} only applies to placement.mode = 'disaggregated'; "
                "a colocated draft runs on every node"
            )
        if p.transfer != "torch":
            raise ConfigError(
                f"placement.transfer = {p.transfer!r} only applies to placement.mode = 'disaggregated'; "
                "a colocated draft reads the target's features in place"
            )
        return
    if not p.draft_nodes:
        raise ConfigError("placement.draft_nodes = [] must list the nodes holding the draft when disaggregated")
    for i, node in enumerate(p.draft_nodes):
        if node >= pc.cluster.nnodes:
            raise ConfigError(
                f"placement.draft_nodes[{i}] = {node} is not a node index in [0, cluster.nnodes = {pc.cluster.nnodes})"
            )
    if len(set(p.draft_nodes)) != len(p.draft_nodes):
        raise ConfigError(f"placement.draft_nodes = {list(p.draft_nodes)} lists a node twice")
    if len(p.draft_nodes) == pc.cluster.nnodes:
        raise ConfigError(
            f"placement.draft_nodes = {list(p.draft_nodes)} leaves no node for the target; "
            "use placement.mode = 'colocated' to run both on every node"
        )
    if p.transfer == "mooncake" and importlib.util.find_spec("mooncake") is None:
        raise ConfigError(
            "placement.transfer = 'mooncake' needs the Mooncake transfer engine: pip install 'epdraft[mooncake]'"
        )


def _check_draft(pc: ParallelConfig) -> None:
    d = pc.draft
    if d.attn_dp != pc.draft_world_size:
        raise ConfigError(
            f"draft.attn_dp = {d.attn_dp} must equal the draft world size {pc.draft_world_size} "
            f"({pc._describe_ranks(pc.draft_ranks)})"
        )
    if d.moe_layout == "replicated":
        for key, value in (("moe_ep", d.moe_ep), ("moe_tp", d.moe_tp)):
            if value != 1:
                raise ConfigError(
                    f"draft.{key} = {value} must be 1 with draft.moe_layout = 'replicated' "
                    "(every rank holds every expert); use 'alltoall' or 'gather' to shard them"
                )
    if d.moe_layout == "alltoall" and d.moe_tp != 1:
        raise ConfigError(f"draft.moe_tp = {d.moe_tp}: alltoall supports moe_tp = 1; use gather for expert-TP")
    if d.attn_dp % d.moe_group_size != 0:
        key, value = ("draft.moe_tp", d.moe_tp) if d.moe_ep == 1 else ("draft.moe_ep", d.moe_ep)
        raise ConfigError(
            f"{key} = {value}: draft.moe_ep x draft.moe_tp = {d.moe_ep} x {d.moe_tp} = {d.moe_group_size} "
            f"must divide draft.attn_dp = {d.attn_dp}"
        )
    if d.a2a_backend in CUDA_A2A_BACKENDS and d.moe_layout != "alltoall":
        raise ConfigError(
            f"draft.a2a_backend = {d.a2a_backend!r} only applies to draft.moe_layout = 'alltoall' "
            f"(got {d.moe_layout!r}); use 'torch'"
        )
    if d.low_latency and d.a2a_backend != "deepep":
        raise ConfigError(
            f"draft.low_latency = true selects DeepEP's low-latency kernels; it needs draft.a2a_backend = 'deepep' "
            f"(got {d.a2a_backend!r})"
        )
    if d.cuda_graphs and pc.cluster.device == "cpu":
        raise ConfigError("draft.cuda_graphs = true needs CUDA but cluster.device = 'cpu'")
    if fixed_row_buffers(d.a2a_backend, d.low_latency) and d.max_rows_per_rank == 0:
        kernels = " (low_latency)" if d.low_latency else ""
        raise ConfigError(
            f"draft.max_rows_per_rank = 0: draft.a2a_backend = {d.a2a_backend!r}{kernels} sizes fixed buffers and "
            "needs the most rows one rank sends per step (requests x block size)"
        )


def check_moe_split(pc: ParallelConfig, ffn: DraftMixFFNSpec, *, source: str = "draft") -> None:
    """Raise ConfigError when draft.moe_ep does not divide a MoE layer's experts, or draft.moe_tp its
    expert intermediate size: every sharded layout (and `auto`'s candidates) splits them evenly.

    The same check the ranks make when they build their expert shard, made where both the
    parallel config and the draft's config are known (`epdraft run` before launching, `epdraft plan`).
    """
    d = pc.draft
    for layer_id in ffn.moe_layers:
        moe = ffn.layers[layer_id]
        if moe.num_experts % d.moe_ep:
            raise ConfigError(
                f"draft.moe_ep = {d.moe_ep} must divide the draft's {moe.num_experts} experts "
                f"({source}, layer {layer_id})"
            )
        if moe.intermediate_size % d.moe_tp:
            raise ConfigError(
                f"draft.moe_tp = {d.moe_tp} must divide the draft's expert intermediate size "
                f"{moe.intermediate_size} ({source}, layer {layer_id})"
            )


def check_standalone_target(pc: ParallelConfig, *, source: str) -> None:
    """Raise ConfigError naming target.tp in `source` (the config file) when it is above 1.

    The standalone runner's target is an HF transformers model loaded whole on every target rank
    (replicated: target.dp = the target ranks); sharding it over target.tp ranks is not
    implemented, so a config asking for it would promise what the runner does not do. An
    embedding engine's own target layout is its own business: only the runner calls this.
    """
    if pc.target.tp > 1:
        raise ConfigError(
            f"{source}: target.tp = {pc.target.tp}: the standalone runner loads the whole HF target on every "
            f"target rank (a tensor-parallel target is not implemented); set target.tp = 1 and "
            f"target.dp = {pc.target_world_size}"
        )


# Loading: file -> dict -> overrides -> msgspec.convert, so every failure becomes a ConfigError with a key path.

_MSGSPEC_PATH = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<key>[^`]+)`")
_MISSING = re.compile(r"Object missing required field `(?P<key>[^`]+)`")


def load_parallel_config(path: str | Path, overrides: Iterable[str] = ()) -> ParallelConfig:
    """Read a ParallelConfig from `.toml`, `.yaml`/`.yml` or `.json` (or a shipped config by name, see
    `resolve_config_path`), apply `--set` overrides, validate.

    Raises ConfigError naming the file (and the overrides), the key path, the value and the expectation.
    """
    path = resolve_config_path(path)
    overrides = list(overrides)
    raw = _read_file(path)
    source = str(path) + (f" (with --set {' '.join(overrides)})" if overrides else "")
    return parallel_config_from_dict(apply_overrides(raw, overrides), source=source)


def shipped_config_names() -> tuple[str, ...]:
    """The names of the configs installed with the package (`epdraft/configs/*.toml`), sorted."""
    return tuple(sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.toml")))


def resolve_config_path(path: str | Path) -> Path:
    """The file a config argument means: `path` itself when it exists, has a suffix or a directory
    part (relative to the working directory, as the shell reads it), else the shipped
    `epdraft/configs/<path>.toml`, so `epdraft run local-cpu-4` works outside the repository.

    Raises ConfigError listing the shipped names when a bare name is neither a file nor shipped.
    """
    p = Path(path)
    if p.exists() or p.suffix or len(p.parts) != 1:
        return p
    shipped = SHIPPED_CONFIGS / f"{p.name}.toml"
    if not shipped.is_file():
        raise ConfigError(
            f"no config {str(path)!r}: not a file, and the shipped configs are {', '.join(shipped_config_names())}"
        )
    return shipped


def parallel_config_from_dict(d: dict[str, Any], source: str = "<dict>") -> ParallelConfig:
    """Validate plain data (as read from a file) into a ParallelConfig; errors name `source`."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a table of sections (cluster, draft, target, placement), got {d!r}")
    try:
        return msgspec.convert(d, ParallelConfig)
    except msgspec.ValidationError as e:
        if isinstance(e.__cause__, ConfigError):
            raise ConfigError(f"{source}: {e.__cause__}") from e.__cause__
        raise ConfigError(f"{source}: {_explain(str(e), d)}") from e


def apply_overrides(d: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of `d` with each `section.key=value` set; the value is parsed as a TOML value
    (`2`, `true`, `[1]`, `"x"`), falling back to the bare string (`gather`)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) != 2 or not all(parts):
            raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. draft.moe_ep=2")
        section, name = parts
        table = out.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"--set {item!r}: {section} is {table!r}, not a table")
        table[name] = _parse_value(text.strip())
    return out


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _read_file(path: Path) -> dict[str, Any]:
    # Read before looking at the suffix: a missing file is reported as missing, whatever its name.
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ConfigError(
            f"{path}: cannot read the parallel config: {e.strerror} (relative to the working directory; a shipped "
            f"config is named without directory or suffix: {', '.join(shipped_config_names())})"
        ) from e
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the parallel config: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x}), expected a UTF-8 config file"
        ) from None
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise ConfigError(f"{path}: unknown config format {suffix!r}; expected .toml, .yaml, .yml or .json")
    if suffix in (".yaml", ".yml"):
        yaml = _yaml(path)
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
    else:
        try:
            data = tomllib.loads(text) if suffix == ".toml" else json.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: not valid {suffix.lstrip('.').upper()}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table of sections (cluster, draft, target, placement), got {data!r}")
    return data


def _yaml(path: Path):
    """PyYAML, an extra (every shipped config is TOML): ConfigError naming the install for a YAML file."""
    try:
        import yaml
    except ImportError:
        raise ConfigError(f"{path}: a YAML config needs PyYAML: pip install 'epdraft[yaml]' (or use TOML)") from None
    return yaml


def _explain(message: str, d: dict[str, Any]) -> str:
    """Turn msgspec's `Expected int >= 1 - at $.draft.moe_ep` into `draft.moe_ep = 0: expected int >= 1`."""
    m = _MSGSPEC_PATH.match(message)
    what, path = m.group("what"), (m.group("path") or "").lstrip(".")
    if u := _UNKNOWN.match(what):
        key = _join(path, u.group("key"))
        return f"{key}: unknown key; valid keys in {path or 'the file'}: {', '.join(_field_names(path))}"
    if miss := _MISSING.match(what):
        return f"{_join(path, miss.group('key'))}: required key is missing"
    value = _lookup(d, path)
    expected = what[0].lower() + what[1:]
    if what.startswith("Invalid enum value"):
        expected = "expected one of " + ", ".join(repr(v) for v in _literal_values(path))
    return f"{path} = {value!r}: {expected}"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _split(path: str) -> list[str | int]:
    return [int(p) if p.isdigit() else p for p in re.findall(r"[^.\[\]]+", path)]


def _lookup(d: Any, path: str) -> Any:
    for part in _split(path):
        d = d[part]
    return d


def _type_at(path: str) -> msgspec.inspect.Type:
    t: msgspec.inspect.Type = msgspec.inspect.type_info(ParallelConfig)
    for part in _split(path):
        if isinstance(part, int):
            t = t.item_type
        else:
            t = next(f.type for f in t.fields if f.name == part)
    return t


def _field_names(path: str) -> list[str]:
    return [f.name for f in _type_at(path).fields]


def _literal_values(path: str) -> tuple[Any, ...]:
    return tuple(_type_at(path).values)
