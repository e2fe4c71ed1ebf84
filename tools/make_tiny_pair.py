"""Train the tiny target/draft pair shipped in `epdraft/assets/` (CPU, a few minutes).

    python tools/make_tiny_pair.py [--out epdraft/assets] [--threads 2]
    python tools/make_tiny_pair.py --tokenizer-only      # (re)write only the target's byte tokenizer

1. A byte-level Qwen3 target (HF `Qwen3ForCausalLM`) trained on a fixed list of the Python standard
   library's own sources (`sysconfig.get_paths()["stdlib"]`); a few other files are held out.
2. A 2-layer DFlash MoE draft (8 experts, top-2, sigmoid-gated shared expert: SpecForge's qwen3_5_moe
   preset), built from epdraft's own modules, trained with the block mask-filling objective on the
   target's features, with the target's own greedy continuations as labels.
3. Writes the target (save_pretrained, safetensors) with its byte-level tokenizer (`write_byte_tokenizer`),
   the draft in SpecForge export form, and held-out prompts; reloads both through the real loaders and
   measures greedy speculative decoding.
See docs/tiny-pair.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from epdraft.models import DFlashDraft, DraftModelSpec, load_draft, speculative_generate
from epdraft.models.checkpoint import to_specforge_state_dict
from epdraft.target.hf import HFTarget

log = logging.getLogger("make_tiny_pair")

BOS, EOS, PAD, MASK = 256, 257, 258, 259
VOCAB = 260
BLOCK = 8
FEATURE_LAYERS = [1, 2]
TRAIN_FILES = (
    "abc.py argparse.py ast.py base64.py bisect.py calendar.py cmd.py code.py codecs.py colorsys.py configparser.py "
    "contextlib.py copy.py csv.py dataclasses.py datetime.py difflib.py dis.py enum.py filecmp.py fnmatch.py "
    "fractions.py ftplib.py functools.py getopt.py gettext.py glob.py gzip.py heapq.py hmac.py inspect.py "
    "ipaddress.py keyword.py linecache.py locale.py mailbox.py netrc.py ntpath.py numbers.py operator.py optparse.py "
    "os.py pickle.py platform.py plistlib.py posixpath.py pprint.py queue.py quopri.py random.py reprlib.py "
    "secrets.py selectors.py shutil.py smtplib.py socket.py statistics.py subprocess.py tarfile.py tempfile.py "
    "threading.py timeit.py trace.py traceback.py types.py typing.py warnings.py weakref.py webbrowser.py zipapp.py"
).split()
HELDOUT_FILES = "shlex.py textwrap.py string.py sched.py tokenize.py uuid.py wave.py bdb.py".split()


def write_byte_tokenizer(directory: Path) -> None:
    """Save the target's tokenizer in `directory`: id b is byte b (0..255, no merges, so every byte
    string round-trips, invalid UTF-8 included), 256-259 the special tokens.

    Bytes are spelled with the ByteLevel byte-to-unicode alphabet GPT-2 uses, so `tokenizers` maps
    text -> UTF-8 bytes -> ids, and back, with no unknown token; without it `--show` and `--output`
    could only print ids and `text` prompts could not be read.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 characters standing for the bytes
    byte_char = _bytes_to_unicode()
    assert sorted(byte_char.values()) == sorted(alphabet)
    tok = Tokenizer(models.BPE(vocab={byte_char[b]: b for b in range(256)}, merges=[]))
    # No regex split and no prefix space: the ids are exactly the text's UTF-8 bytes.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
    tok.add_special_tokens([*specials.values(), "<|mask|>"])  # ids 256-259: BOS, EOS, PAD, MASK
    assert [tok.token_to_id(t) for t in (*specials.values(), "<|mask|>")] == [BOS, EOS, PAD, MASK]
    PreTrainedTokenizerFast(tokenizer_object=tok, **specials).save_pretrained(directory)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ByteLevel pre-tokenizes bytes into)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def read_corpus(names: list[str]) -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"])
    data = bytearray()
    for name in names:
        path = root / name
        if path.is_file():
            data += path.read_bytes() + b"\n"
        else:
            log.warning("stdlib file %s not found in %s: skipped", name, root)
    return torch.tensor(list(data), dtype=torch.long)


def windows(corpus: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, corpus.numel() - length, (n,), generator=gen)
    return torch.stack([corpus[s : s + length] for s in starts.tolist()])


def lr_at(step: int, steps: int, peak: float) -> float:
    warm = max(steps // 20, 1)
    if step < warm:
        return peak * (step + 1) / warm
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(steps - warm, 1))))


def train_target(corpus: torch.Tensor, steps: int, gen: torch.Generator) -> Qwen3ForCausalLM:
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
    )
    model = Qwen3ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.05)
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, 3e-3)
        batch = windows(corpus, 16, 128, gen)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log.info("target step %d/%d loss %.3f (%.0fs)", step, steps, loss.item(), time.time() - t0)
    return model.eval()


@torch.no_grad()
def distill_data(target: Qwen3ForCausalLM, corpus: torch.Tensor, n: int, gen: torch.Generator):
    """Prompts from the training text + the target's greedy continuations; features and greedy labels."""
    seqs = []
    for chunk in windows(corpus, n, 64, gen).split(128):
        out = target.generate(chunk, attention_mask=torch.ones_like(chunk), max_new_tokens=128, do_sample=False,
                              min_new_tokens=128, pad_token_id=PAD, eos_token_id=None)
        seqs.append(out)
    ids = torch.cat(seqs)
    feats, preds = [], []
    for chunk in ids.split(64):
        out = target(input_ids=chunk, output_hidden_states=True)
        feats.append(torch.cat([out.hidden_states[j + 1] for j in FEATURE_LAYERS], dim=-1))
        preds.append(out.logits.argmax(-1))
    return ids, torch.cat(feats), torch.cat(preds)


def draft_config(target_cfg: Qwen3Config) -> dict:
    """The draft's config.json, in SpecForge's DFlash MoE export form (qwen3_5_moe preset)."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": target_cfg.hidden_size,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2,
        "intermediate_size": 384, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 1024, "vocab_size": VOCAB, "attention_bias": False, "tie_word_embeddings": False,
        "num_target_layers": target_cfg.num_hidden_layers, "block_size": BLOCK, "torch_dtype": "float32",
        "moe_preset": "qwen3_5_moe", "n_routed_experts": 8, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 96, "shared_expert_intermediate_size": 192, "n_shared_experts": 1,
        "scoring_func": "softmax", "norm_topk_prob": True, "routed_scaling_factor": 1.0, "n_group": 1,
        "topk_group": 1, "topk_method": "greedy", "moe_router_bias": False,
        "dflash_config": {"block_size": BLOCK, "mask_token_id": MASK, "target_layer_ids": FEATURE_LAYERS},
    }


def init_draft(draft: DFlashDraft) -> None:
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    draft.requires_grad_(True)


def block_batch(ids, feats, preds, rows: torch.Tensor, gen: torch.Generator, blocks: int):
    """SpecForge-style training batch: `blocks` anchors per sequence, each block over its own context."""
    N, L = len(rows), ids.shape[1]
    anchors = torch.stack([torch.randperm(L - 24, generator=gen)[:blocks] + 16 for _ in range(N)]).sort(1).values
    k = torch.arange(BLOCK)
    pos_NQ = (anchors.unsqueeze(-1) + k).reshape(N, -1)                       # a .. a+B-1 per block
    x_ids = torch.full((N, blocks, BLOCK), MASK)
    x_ids[:, :, 0] = ids[rows].gather(1, anchors)
    labels = preds[rows].gather(1, (anchors.unsqueeze(-1) + k - 1).clamp(min=0).reshape(N, -1)).view(N, blocks, BLOCK)
    q_anchor = anchors.repeat_interleave(BLOCK, dim=1)                         # [N, Q]
    ctx_ok = torch.arange(L).view(1, 1, L) < q_anchor.unsqueeze(-1)            # strictly before the anchor
    q_block = torch.arange(blocks).repeat_interleave(BLOCK)
    blk_ok = (q_block.view(-1, 1) == q_block.view(1, -1)).expand(N, -1, -1)    # whole own block
    return x_ids.view(N, -1), pos_NQ, feats[rows], torch.cat([ctx_ok, blk_ok], dim=-1), labels[:, :, 1:]


def train_draft(draft, target, data, steps: int, gen: torch.Generator) -> None:
    ids, feats, preds = data
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=2e-3, weight_decay=0.0)
    decay = torch.exp(-torch.arange(BLOCK - 1, dtype=torch.float32) / 4.0)   # early drafts gate acceptance
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, 2e-3)
        rows = torch.randint(0, ids.shape[0], (16,), generator=gen)
        x_ids, pos, f, allowed, labels = block_batch(ids, feats, preds, rows, gen, blocks=6)
        ctx_pos = torch.arange(ids.shape[1]).expand(len(rows), -1)
        with torch.no_grad():
            x = embed(x_ids)
        hidden = draft(x, pos, draft.fuse_features(f), ctx_pos, allowed).view(len(rows), -1, BLOCK, x.shape[-1])
        logits = lm_head(hidden[:, :, 1:])
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view(labels.shape)
        loss = (ce * decay).sum(-1).mean() / decay.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            acc = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
            log.info("draft step %d/%d loss %.3f acc@k1 %.2f acc@k7 %.2f (%.0fs)", step, steps, loss.item(),
                     acc[0].item(), acc[-1].item(), time.time() - t0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "epdraft" / "assets")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1 is fastest on a busy machine)")
    parser.add_argument("--target-steps", type=int, default=1200)
    parser.add_argument("--draft-steps", type=int, default=1000)
    parser.add_argument("--eval-prompts", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-only", action="store_true",
                        help="write only the byte-level tokenizer into OUT/tiny-target (no training)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.tokenizer_only:
        write_byte_tokenizer(args.out / "tiny-target")
        return 0
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    t_start = time.time()

    train, heldout = read_corpus(TRAIN_FILES), read_corpus(HELDOUT_FILES)
    log.info("corpus: %d train bytes from %d files, %d held-out bytes", train.numel(), len(TRAIN_FILES), heldout.numel())
    target = train_target(train, args.target_steps, gen)
    with torch.no_grad():
        val = windows(heldout, 32, 128, gen)
        log.info("target held-out loss %.3f nats/byte", target(input_ids=val, labels=val).loss.item())

    data = distill_data(target, train, 384, gen)
    log.info("distillation data: %d sequences of %d tokens (%.0fs)", data[0].shape[0], data[0].shape[1], time.time() - t_start)
    cfg = draft_config(target.config)
    draft = DFlashDraft(DraftModelSpec.from_config(cfg))
    init_draft(draft)
    train_draft(draft, target, data, args.draft_steps, gen)

    target_dir, draft_dir = args.out / "tiny-target", args.out / "tiny-draft"
    target.save_pretrained(target_dir, safe_serialization=True)
    write_byte_tokenizer(target_dir)
    draft_dir.mkdir(parents=True, exist_ok=True)
    (draft_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(to_specforge_state_dict(draft), str(draft_dir / "model.safetensors"), metadata={"format": "pt"})
    prompts = [windows(heldout, 1, 64, gen)[0].tolist() for _ in range(32)]
    with open(args.out / "prompts.jsonl", "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": i, "text": bytes(p).decode("utf-8", "replace"), "input_ids": p}) + "\n")

    # Reload both through the real loaders and decode held-out prompts speculatively.
    hf = HFTarget.from_pretrained(target_dir, FEATURE_LAYERS)
    loaded = load_draft(draft_dir)
    accepts, lossless, new_tokens = [], True, 64
    for i, p in enumerate(prompts[: args.eval_prompts]):
        out = speculative_generate(hf, loaded, p, new_tokens, request_id=i)
        ref = hf.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                pad_token_id=PAD, eos_token_id=None)[0, len(p):].tolist()
        lossless &= out.tokens == ref
        if i == 0:
            log.info("held-out prompt 0: %r -> %r", bytes(p[-32:]).decode("utf-8", "replace"),
                     bytes(t for t in out.tokens if t < 256).decode("utf-8", "replace"))
        accepts += out.accept_lens
    mean_acc = sum(accepts) / len(accepts)
    size = sum(p.stat().st_size for d in (target_dir, draft_dir) for p in d.iterdir())
    log.info("held-out greedy speculative decoding, block size %d, %d prompts x %d tokens: lossless %s",
             BLOCK, args.eval_prompts, new_tokens, "OK" if lossless else "FAIL")
    log.info("mean accepted drafts per verify step %.2f; mean tokens per verify step %.2f (accepted + bonus)",
             mean_acc, mean_acc + 1)
    log.info("assets %.2f MB; total time %.0fs", size / 1e6, time.time() - t_start)
    return 0 if lossless else 1


if __name__ == "__main__":
    raise SystemExit(main())
