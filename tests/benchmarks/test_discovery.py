"""Discovering and selecting the case families (:mod:`benchmarks.discovery`)."""

from __future__ import annotations

import io
import sys
import textwrap

import pytest

from benchmarks import devices, discovery, metadata, runner, schema
from tests.support.benchmark_fakes import CPU, FakeClock, tiny_settings


def test_discovery_reads_families_without_importing_them(fake_package):
    by_name = {f.name: f for f in fake_package}
    assert [f.name for f in fake_package] == [  # ORDER first, then by file name.
        "raising",
        "alpha",
        "broken",
        "counted",
        "nameless",
        "optional",
    ]
    assert by_name["broken"].problem is None  # Found statically; fails only on import.
    assert by_name["optional"].default is False
    assert "defines no FAMILY" in by_name["nameless"].problem
    assert "fakebench_pkg.bench_broken" not in sys.modules


def test_select_default_excludes_optional_families(fake_package):
    default = [f.name for f in discovery.select(fake_package, None)]
    assert "optional" not in default and "alpha" in default
    assert [f.name for f in discovery.select(fake_package, "optional")] == ["optional"]
    assert len(discovery.select(fake_package, "all")) == len(fake_package)


def test_select_unknown_family_lists_the_known_ones(fake_package):
    with pytest.raises(discovery.UnknownFamilyError) as info:
        discovery.select(fake_package, "alpha,nope")
    message = str(info.value)
    assert "'nope'" in message
    for name in ("alpha", "broken", "raising", "optional (optional)"):
        assert name in message


def test_real_families_are_discovered():
    names = {f.name for f in discovery.discover()}
    assert {"eager", "graph", "contention", "snapshot"} <= names
    assert all(f.problem is None for f in discovery.discover()), discovery.discover()


def test_plot_against_is_read_statically_and_recorded(tmp_path, monkeypatch):
    package = tmp_path / "scalingbench_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "bench_scaling.py").write_text(
        textwrap.dedent(
            """
            from benchmarks.case import Case
            FAMILY = "scaling"
            PLOT_AGAINST = "variables"
            def cases(ctx):
                return [Case("scaling", f"{n}", {"plain": int, "safe": int},
                             params={"variables": n}) for n in (20, 200)]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    (info,) = discovery.discover(package, "scalingbench_pkg")
    assert info.plot_against == "variables"
    assert "scalingbench_pkg.bench_scaling" not in sys.modules  # read, not imported
    ctx = devices.make_context(CPU, True)
    (family,) = runner.run_families(
        [info], ctx, tiny_settings(), progress=io.StringIO(), clock=FakeClock([])
    )
    assert family["plot_against"] == "variables"
    document = runner.build_document(metadata.collect(CPU, True), tiny_settings(), ctx, [family])
    assert schema.validate(document) == []
    del document["families"][0]["plot_against"]  # documents from before it stay valid
    assert schema.validate(document) == []


def test_seconds_is_read_statically_and_bad_entries_are_ignored(tmp_path):
    package = tmp_path / "secondsbench_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "bench_timed.py").write_text(
        'FAMILY = "timed"\nSECONDS = {"full": 40, "quick": 2.5, "other": "long", "x": -1}\n'
    )
    (package / "bench_untimed.py").write_text('FAMILY = "untimed"\n')
    timed, untimed = discovery.discover(package, "secondsbench_pkg")
    assert timed.expected_seconds("full") == 40.0 and timed.expected_seconds("quick") == 2.5
    assert timed.expected_seconds("other") is None
    assert untimed.expected_seconds("full") is None


def test_every_real_family_says_how_long_it_runs():
    for family in discovery.discover():
        assert family.expected_seconds("full") and family.expected_seconds("quick"), family.name
