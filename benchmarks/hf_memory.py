"""Memory of starting from a pretrained model and of the loss at a large vocabulary (issue 28).

Each measurement runs in a fresh Python process and reports its peak resident set size
(``VmHWM``) above the process's size just before the measured code (``/proc/self/clear_refs``
resets the peak), so imports and the inputs do not count. "before" runs the code of a git
revision (``--before``, default :data:`BEFORE`, the last one before this work), unpacked with ``git archive``;
"after" runs this checkout's.

1. Loading: one worker loads a Llama-shaped model of about 0.5B parameters (24 layers, hidden
   1280, 20 heads, vocabulary 32000, tied embeddings: a shape the old ``--model.*`` options
   could express), with random float32 weights saved locally by ``save_pretrained``.
   before: ``initial_model(read_initial_weights(DIR))`` (the model loaded, a random model of
   the configured shape built, the weights copied into it); after:
   ``preflight_init_from(DIR).load()`` (weights loaded straight into the model). Every
   parameter is read once after the load (a parameter still mapped from the file and never
   read is not resident; training reads them all). Also the
   pre-flight alone (after: config.json and safetensors headers; before: the same load as a
   worker's).
2. The loss at a 128k vocabulary (128256, Llama 3), micro-batch 8 x 256, hidden 1024, float32:
   forward and backward of the output layer and cross-entropy. before: the whole
   ``(B, T, V)`` logits and ``.float()``; after: ``chunked_cross_entropy``.

Usage: ``python benchmarks/hf_memory.py [--before REV] [--work DIR] [--out FILE.md]``. Needs
about 10 GB of memory and 2 GB of disk (the saved model).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: The 0.5B Llama-shaped model (old options: key-value heads = heads, tied, 8/3 MLP rule).
SHAPE = {"n_layer": 24, "n_embd": 1280, "n_head": 20, "block_size": 128}
VOCAB = 32000

#: The last revision before issue 28's model work (the old loading path and loss).
BEFORE = "136eaef"

PEAK = textwrap.dedent(
    """
    import json, sys, time
    def _status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    def touch(model):
        # Read every parameter: weights mapped from the file but not yet read are not
        # resident, and training reads them all.
        sum(float(p.sum()) for p in model.parameters())
        return model
    def measure(run):
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # the peak (VmHWM) restarts from the current size
        base = _status("VmRSS:")
        started = time.perf_counter()
        import lowcomm
        print("lowcomm from", lowcomm.__file__, file=sys.stderr)
        result = run()
        seconds = time.perf_counter() - started
        print(json.dumps({"base": base, "peak": _status("VmHWM:"), "seconds": seconds}))
        return result
    """
)

SAVE = """
import torch, transformers, sys
torch.manual_seed(0)
config = transformers.LlamaConfig(
    vocab_size={vocab}, hidden_size={n_embd}, num_hidden_layers={n_layer},
    num_attention_heads={n_head}, num_key_value_heads={n_head},
    intermediate_size=64 * -(-(8 * {n_embd} // 3) // 64), max_position_embeddings={block_size},
    tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
model = transformers.AutoModelForCausalLM.from_config(config)
model.save_pretrained(sys.argv[1])
print(sum(p.numel() for p in model.parameters()))
"""

LOAD_BEFORE = """
from lowcomm.models import ModelConfig
from lowcomm.models.init_from import initial_model, read_initial_weights
config = ModelConfig(family="hf-llama", {options})
model = measure(lambda: touch(initial_model(config, read_initial_weights(sys.argv[1]))))
"""

LOAD_AFTER = """
from lowcomm.models import ModelConfig
from lowcomm.models.init_from import preflight_init_from
model = measure(lambda: touch(preflight_init_from(sys.argv[1], ModelConfig(block_size=128)).load()))
"""

PREFLIGHT_AFTER = """
from lowcomm.models import ModelConfig
from lowcomm.models.init_from import preflight_init_from
measure(lambda: preflight_init_from(sys.argv[1], ModelConfig(block_size=128)))
"""

LOSS = """
import torch, torch.nn.functional as F
torch.manual_seed(0)
rows, hidden_size, vocab = 8 * 256, 1024, 128256
hidden = torch.randn(rows, hidden_size, requires_grad=True)
weight = (torch.randn(vocab, hidden_size) * 0.02).requires_grad_()
targets = torch.randint(0, vocab, (rows,))
def before():
    logits = F.linear(hidden, weight)
    F.cross_entropy(logits.reshape(-1, vocab).float(), targets).backward()
def after():
    from lowcomm.models.loss import chunked_cross_entropy
    chunked_cross_entropy(hidden, weight, targets).backward()
measure({which})
"""


def _python(code: str, source: Path, *args: str) -> dict[str, float]:
    """Run ``code`` (with :data:`PEAK`) on lowcomm's ``source`` tree; its last JSON line."""
    environment = {**os.environ, "PYTHONPATH": str(source), "OMP_NUM_THREADS": "2"}
    result = subprocess.run(
        [sys.executable, "-c", PEAK + code, *args],
        capture_output=True, text=True, env=environment, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    assert f"lowcomm from {source}" in result.stderr, result.stderr[-3000:]
    measured: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return measured


def _old_tree(revision: str, work: Path) -> Path:
    target = work / f"src-{revision}"
    if not target.exists():
        target.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", revision, "src"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target / "src"


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=BEFORE)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "hf-memory")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    old, new = _old_tree(args.before, args.work), REPO / "src"
    model = args.work / "llama-0.5b"
    if not (model / "model.safetensors").exists():
        code = SAVE.format(vocab=VOCAB, **SHAPE)
        subprocess.run([sys.executable, "-c", code, str(model)], check=True)
    weights = (model / "model.safetensors").stat().st_size
    options = ", ".join(f"{k}={v}" for k, v in SHAPE.items())
    # The old pre-flight ran the worker's load in the launcher: one measurement serves both.
    old_load = _python(LOAD_BEFORE.format(options=options), old, str(model))
    rows = [
        ("load, one worker", old_load, _python(LOAD_AFTER, new, str(model))),
        ("pre-flight (launcher)", old_load, _python(PREFLIGHT_AFTER, new, str(model))),
    ]
    loss = [
        ("loss, V=128256, 8 x 256, H=1024",
         _python(LOSS.format(which="before"), old), _python(LOSS.format(which="after"), new)),
    ]  # fmt: skip
    lines = [
        f"weights: {model} ({_gib(weights)} GiB of float32 safetensors); before = "
        f"{args.before[:12]}, after = this checkout",
        "",
        "| measurement | before: peak RSS above start (GiB) | x weights | s | "
        "after: peak RSS above start (GiB) | x weights | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, before, after in rows:
        b, a = before["peak"] - before["base"], after["peak"] - after["base"]
        lines.append(
            f"| {name} | {_gib(b)} | {b / weights:.2f} | {before['seconds']:.1f} | {_gib(a)} | "
            f"{a / weights:.2f} | {after['seconds']:.1f} |"
        )
    lines += ["", "| measurement | before: peak above start (GiB) | after (GiB) | ratio |",
              "|---|---|---|---|"]  # fmt: skip
    for name, before, after in loss:
        b, a = before["peak"] - before["base"], after["peak"] - after["base"]
        lines.append(f"| {name} | {_gib(b)} | {_gib(a)} | {b / max(a, 1):.1f}x |")
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
