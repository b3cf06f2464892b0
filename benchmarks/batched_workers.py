"""Does batching the in-process workers' forward and backward into one call pay? (issue 30 item 4)

K workers in one process each hold their own copy of the small model (2 layers, width 64) and
compute the gradient of their own micro-batch. Three ways to do that work on this machine, timed
side by side (min and median of ``--repeats`` rounds of ``--steps`` micro-batches each):

* ``loop``: one worker after another, each its own forward and backward (what the in-process
  workers do, minus the threads);
* ``vmap``: one batched call, ``torch.func.vmap`` of ``functional_call`` over the K workers'
  stacked parameters, ``torch.func.grad`` giving every worker's gradient at once;
* ``one model``: the limit, one model on the K micro-batches as one batch (the same tokens, one
  set of parameters: what the batched call cannot beat).

Tokens per second of each, and the ratios to ``loop``, are printed; the gradients of ``vmap``
are checked against ``loop``'s first.

    python benchmarks/batched_workers.py --workers 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.func import functional_call, grad, vmap

from lowcomm.models.gpt import GPT, GPTConfig


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    return parser.parse_args()


def models(args: argparse.Namespace) -> list[GPT]:
    config = GPTConfig(
        n_layer=2, n_embd=64, n_head=2, block_size=args.block_size, vocab_size=args.vocab_size
    )
    return [GPT(config) for _ in range(args.workers)]


def batches(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), shaped (K, micro-batch, context)."""
    generator = torch.Generator().manual_seed(0)
    shape = (args.workers, args.micro_batch_size, args.block_size + 1)
    tokens = torch.randint(0, args.vocab_size, shape, generator=generator)
    return tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()


def loop_step(workers: list[GPT], inputs: torch.Tensor, targets: torch.Tensor) -> None:
    for model, x, y in zip(workers, inputs, targets, strict=True):
        model.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        assert loss is not None
        loss.backward()


def vmap_step_fn(
    workers: list[GPT],
) -> tuple[
    Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]], dict[str, torch.Tensor]
]:
    """The batched gradient function and the K workers' stacked parameters."""
    base = workers[0]
    stacked = {
        name: torch.stack([dict(m.named_parameters())[name].detach() for m in workers])
        for name, _ in base.named_parameters()
    }

    def loss_of(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, loss = functional_call(base, params, (x, y))
        assert loss is not None
        return loss

    per_worker = vmap(grad(loss_of), in_dims=(0, 0, 0))

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        return per_worker(stacked, inputs, targets)  # type: ignore[no-any-return]

    return step, stacked


def one_model_step(model: GPT, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    _, loss = model(inputs.flatten(0, 1), targets.flatten(0, 1))
    assert loss is not None
    loss.backward()


def timed(step: Callable[[], object], steps: int, repeats: int) -> list[float]:
    step()  # warm-up
    seconds = []
    for _ in range(repeats):
        begin = time.perf_counter()
        for _ in range(steps):
            step()
        seconds.append((time.perf_counter() - begin) / steps)
    return seconds


def check_vmap(workers: list[GPT], inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Largest relative difference between vmap's gradients and the loop's."""
    loop_step(workers, inputs, targets)
    step, _ = vmap_step_fn(workers)
    grads = step(inputs, targets)
    worst = 0.0
    for name, parameter in workers[0].named_parameters():
        for k, model in enumerate(workers):
            want = dict(model.named_parameters())[name].grad
            assert want is not None
            got = grads[name][k]
            worst = max(worst, float((got - want).norm() / want.norm().clamp_min(1e-30)))
        del parameter
    return worst


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    workers = models(args)
    inputs, targets = batches(args)
    difference = check_vmap(workers, inputs, targets)
    step, _ = vmap_step_fn(workers)
    tokens = inputs.numel()
    results = {
        "loop": timed(lambda: loop_step(workers, inputs, targets), args.steps, args.repeats),
        "vmap": timed(lambda: step(inputs, targets), args.steps, args.repeats),
        "one model": timed(
            lambda: one_model_step(workers[0], inputs, targets), args.steps, args.repeats
        ),
    }
    print(
        f"K = {args.workers} workers, micro-batch {args.micro_batch_size} x {args.block_size}, "
        f"2 layers width 64, vocab {args.vocab_size}, {args.threads} thread(s); vmap's gradients "
        f"within {difference:.1e} (relative) of the loop's"
    )
    loop_median = statistics.median(results["loop"])
    print(f"{'way':<10} {'min ms':>8} {'median ms':>10} {'tokens/s':>10} {'vs loop':>8}")
    for name, seconds in results.items():
        median = statistics.median(seconds)
        print(
            f"{name:<10} {min(seconds) * 1e3:>8.1f} {median * 1e3:>10.1f} "
            f"{tokens / median:>10,.0f} {loop_median / median:>7.2f}x"
        )


if __name__ == "__main__":
    main()
