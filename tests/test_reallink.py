"""A real slow link: Gloo workers in network namespaces joined by tbf-shaped veth pairs.

The test builds the namespaces itself (unique names with this process's id), sends traffic
only inside them and removes them. Skipped, with the reason, where namespaces cannot be made
(not root, no iproute2, no tbf). DDP's exposed communication must lie within 2x of the ring
model's; the shaping (100 Mbit/s, a 2.6 MB gradient, a few milliseconds of compute) makes
communication dominate DDP's step so the band is robust.
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
import tyro

from lowcomm.bench.reallink import (
    FRAME,
    TCP_PAYLOAD,
    MethodResult,
    RealLinkBench,
    RealLinkResult,
    ddp_comparison,
    format_report,
    goodput_gbps,
    namespaces_available,
    run_method_on_star,
    run_method_virtual,
    seconds_per_step,
    shaped_star,
    virtual_args,
)
from lowcomm.config import TrainConfig
from lowcomm.data import DataConfig, prepare_corpus
from lowcomm.train.context import network_profile

pytestmark = pytest.mark.slow


def _namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return {line.split()[0] for line in listing.stdout.splitlines() if line.strip()}


@pytest.fixture(scope="module")
def reason_unavailable() -> str | None:
    return namespaces_available()


@pytest.mark.benchmark  # a timing claim on a real shaped link: make test-benchmarks
def test_ddp_matches_the_model_and_overlap_beats_it(
    tmp_path: Path, reason_unavailable: str | None
) -> None:
    if reason_unavailable is not None:
        pytest.skip(f"network namespaces unavailable: {reason_unavailable}")
    bench = RealLinkBench(workers=2, bandwidth_mbit=100.0, steps=4, methods=("ddp", "acco"))
    prepare_corpus(DataConfig(micro_batch_size=bench.micro_batch_size))
    before = _namespaces()
    with shaped_star(bench.workers, bench.bandwidth_mbit) as star:
        created = {star.hub} | {star.namespace(r) for r in range(bench.workers)}
        assert created <= _namespaces()
        ddp = run_method_on_star(star, bench, "ddp", tmp_path / "ddp")
        acco = run_method_on_star(star, bench, "acco", tmp_path / "acco")
    # Everything created is gone, nothing else was touched.
    assert not created & _namespaces()
    assert _namespaces() - before == set()

    assert len(ddp.exposed_comm_s_per_step) == bench.steps
    assert len(acco.exposed_comm_s_per_step) == bench.steps
    payload, measured, predicted = ddp_comparison(ddp, bench.workers, bench.bandwidth_mbit)
    assert payload > 1e6  # a few MB of gradient, so the transfer dwarfs the compute
    ratio = measured / predicted
    assert 0.5 <= ratio <= 2.0, (
        f"DDP exposed {measured * 1e3:.1f} ms/step on the shaped link vs the model's "
        f"{predicted * 1e3:.1f} ms (ratio {ratio:.3f})"
    )
    assert acco.utilization > ddp.utilization
    # The veths' counters saw at least what lowcomm counted (frames add headers; the initial
    # parameter broadcast and the rendezvous are not counted as training traffic).
    counted = sum(ddp.bytes_sent_per_step)
    assert ddp.wire_bytes_per_worker is not None
    assert counted <= ddp.wire_bytes_per_worker <= 2 * counted
    # ACCO's reduce-scatters move the ring's bytes on Gloo too (an exchange and a local sum;
    # Gloo's own reduce-scatter moved an all-reduce's, 1.6x the count in all).
    counted = sum(acco.bytes_sent_per_step)
    assert acco.wire_bytes_per_worker is not None
    assert counted <= acco.wire_bytes_per_worker <= 1.25 * counted
    # The same run on the virtual clock with the link declared: the modeled time per step is
    # the shaped link's within 2x (the benchmark reports the ratio; its goal is 10%).
    virtual = run_method_virtual(bench, "ddp", tmp_path / "ddp-virtual")
    assert virtual.wire_bytes_per_worker is None
    assert virtual.bytes_sent_per_step == ddp.bytes_sent_per_step
    ratio = seconds_per_step(virtual) / seconds_per_step(ddp)
    assert 0.5 <= ratio <= 2.0, ratio


def test_an_unbuildable_star_is_refused_and_leaves_nothing(
    reason_unavailable: str | None,
) -> None:
    if reason_unavailable is not None:
        pytest.skip(f"network namespaces unavailable: {reason_unavailable}")
    before = _namespaces()
    with pytest.raises(ValueError, match="--workers"), shaped_star(5, 100.0):
        pass
    with pytest.raises(ValueError, match="--bandwidth-mbit"), shaped_star(2, float("nan")):
        pass
    assert _namespaces() == before


def test_bench_without_root_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lowcomm import cli

    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "reallink"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("lowcomm: error: bench reallink:") and "root" in err
    assert len(err.splitlines()) == 1


def test_the_virtual_run_declares_the_shaped_link_at_its_goodput(tmp_path: Path) -> None:
    bench = RealLinkBench(workers=3, bandwidth_mbit=100.0, steps=5)
    args = virtual_args(bench, "co2", tmp_path / "run")
    config = tyro.cli(TrainConfig, args=args, config=(tyro.conf.FlagConversionOff,))
    assert (config.comm.clock, config.comm.network, config.placement.workers) == (
        "virtual",
        "wan",
        3,
    )
    assert (config.method, config.run.steps, config.comm.seconds_per_microbatch) == ("co2", 5, None)
    profile = network_profile(config.comm)
    assert profile.latency_ms == 0.0
    # tbf meters 1514-byte frames that carry 1448 bytes of TCP payload each.
    assert profile.bandwidth_gbps == pytest.approx(0.1 * 1448 / 1514)
    assert goodput_gbps(1000.0) == pytest.approx(TCP_PAYLOAD / FRAME)


def test_seconds_per_step_leaves_out_the_first_step() -> None:
    result = MethodResult(
        method="ddp", exposed_comm_s_per_step=[], bytes_sent_per_step=[], utilization=1.0,
        wall_clock_s=9.0, clock_s_per_step=[5.0, 6.0, 7.5, 9.0],
    )  # fmt: skip
    assert seconds_per_step(result) == pytest.approx(4.0 / 3)
    with pytest.raises(ValueError, match="1 step"):
        seconds_per_step(dataclasses.replace(result, clock_s_per_step=[5.0]))


def test_the_report_keeps_its_columns_with_long_method_names() -> None:
    def run(method: str, wall: float) -> MethodResult:
        return MethodResult(
            method=method, exposed_comm_s_per_step=[0.1, 0.1], bytes_sent_per_step=[1e6, 1e6],
            utilization=0.5, wall_clock_s=wall, clock_s_per_step=[1.0, wall],
            wire_bytes_per_worker=2.2e6,
        )  # fmt: skip

    methods = {name: run(name, 2.0) for name in ("ddp", "streaming_diloco")}
    result = RealLinkResult(
        workers=2, bandwidth_mbit=100.0, payload_bytes=1e6, measured_exposed_s=0.1,
        predicted_s=0.1, ratio=1.0, methods=methods,
        virtual={name: run(name, 1.9) for name in methods},
    )  # fmt: skip
    lines = format_report(result)
    for marker in ("wire/counted", "0.900"):  # a bytes row and a real-vs-virtual row each
        rows = [line for line in lines if marker in line and line.lstrip().split()[0] in methods]
        assert len(rows) == 2
        assert len({row.index(marker) for row in rows}) == 1, rows  # aligned
