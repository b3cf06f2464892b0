"""Your own model, data and loss through the whole lowcomm run: a tiny CNN on generated
images, trained by DiLoCo on 2 workers over an emulated WAN, with the virtual clock,
checkpoints, metrics and plots of ``lowcomm train``.

    python examples/fit_cnn.py                      # diloco, 2 workers
    python examples/fit_cnn.py --method desloc --steps 40

The model, dataset and loss live in examples/tiny_cnn.py: the worker processes import them.
"""

from __future__ import annotations

import argparse

from tiny_cnn import Bars, TinyCNN, cross_entropy

import lowcomm
from lowcomm.data import DataConfig
from lowcomm.optim.adamw import AdamWConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="diloco")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="runs/fit-cnn")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    config = lowcomm.TrainConfig(
        optim=AdamWConfig(lr=3e-3),
        data=DataConfig(micro_batch_size=16),
        run=lowcomm.RunConfig(eval_every=10, checkpoint_every=10),
        # the virtual clock charges a declared device's cost
        comm=lowcomm.CommConfig(seconds_per_microbatch=0.02),
    )
    options = lowcomm.DiLoCoOptions(sync_every=5) if args.method == "diloco" else None
    result = lowcomm.fit(
        TinyCNN,  # a factory: each worker builds its replica (worker 0's weights are broadcast)
        Bars(2048, seed=0),
        Bars(256, seed=1),
        loss_fn=cross_entropy,
        method=args.method,
        options=options,
        workers=args.workers,
        steps=args.steps,
        network="wan",
        out=args.out,
        overwrite=args.overwrite,
        config=config,
    )
    assert result.summary is not None
    print(f"final validation loss {result.summary['final_val_loss']:.3f} in {result.run_dir}")


if __name__ == "__main__":
    main()
