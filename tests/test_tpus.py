"""The TPU table (runner/device/tpus.json, runner/device/tpus.py): every fact with its source, the generation parsed
in one place, the zones checked by `runner submit`, TPU7x through GKE only and never priced.

Nothing here needs a cloud: the table is read as the modules read it, and `runner submit --dry-run` runs as a user
runs it (offline: a refusal happens before any call, a dry run makes none).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys

import pytest
import yaml

from runner import SpecError
from runner.cloud import tpu_types
from runner.cloud.engines import gke, vertex
from runner.device import peak, tpus
from tests.conftest import REPO
from tests.support.engines import submit

pytest_plugins = ["tests.support.cloud_fixtures"]  # cloud_spec

TABLE = json.loads(tpus.TABLE.read_text())
GENERATIONS = tpus.generations()


def _sources_named(value) -> list[str]:
    """Every `source`/`*_source` key's value anywhere under `value`."""
    if isinstance(value, dict):
        found = [v for k, v in value.items() if (k == "source" or k.endswith("_source")) and isinstance(v, str)]
        return found + [s for v in value.values() for s in _sources_named(v)]
    if isinstance(value, list):
        return [s for v in value for s in _sources_named(v)]
    return []


# --- the table ----------------------------------------------------------------------------------------


def test_every_fact_of_every_generation_names_a_source_the_table_holds() -> None:
    for row in TABLE["generations"]:
        named = _sources_named(row)
        assert row["source"] in TABLE["sources"], row["name"]
        assert all(key in TABLE["sources"] and TABLE["sources"][key] for key in named), (row["name"], named)
        for part in ("peak", "gke", "vertex"):
            assert row[part] is None or row[part].get("source"), (row["name"], part)
        for backend in tpus.BACKENDS:
            runtime = row["runtime"][backend]
            assert (runtime and runtime["version"] and runtime["source"]) or row["no_runtime"][backend], row["name"]
        assert row["zones"] and row["zones_source"], row["name"]
        assert all(re.fullmatch(r"[a-z]+-[a-z]+\d+-[a-z0-9]+", zone) for zone in row["zones"]), row["zones"]
    assert set(_sources_named(TABLE)) <= set(TABLE["sources"]), "a source named nowhere defined"
    unused = set(TABLE["sources"]) - set(_sources_named(TABLE)) - {r.get("also") for r in TABLE["prices"]}
    assert unused == set(), f"sources no fact names: {unused}"


def test_the_jax_runtimes_are_the_ones_googles_runtimes_page_names() -> None:
    jax = {name: g.runtime("jax")[0] for name, g in GENERATIONS.items()}
    assert jax == {"tpu7x": None, "v6e": "v2-alpha-tpuv6e", "v5litepod": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5",
                   "v4": "tpu-ubuntu2204-base", "v3": "tpu-ubuntu2204-base", "v2": "tpu-ubuntu2204-base"}
    assert "cloud.google.com/tpu/docs/runtimes" in GENERATIONS["v6e"].runtime("jax")[1]
    version, why = GENERATIONS["tpu7x"].runtime("jax")
    assert version is None and "Cloud TPU API does not support TPU7x" in why


@pytest.mark.parametrize("tpu_type, hosts, chips", [("v6e-16", 4, 16), ("v6e-32", 8, 32), ("v5litepod-16", 4, 16),
                                                    ("v5litepod-32", 8, 32), ("v5p-16", 2, 8), ("v5p-32", 4, 16)])
def test_the_multi_host_slices_have_the_hosts_googles_tables_give(tpu_type, hosts, chips) -> None:
    """One TPU VM (a JAX process) per 4 chips: Google's v6e table (4x4: 4 VMs), its v5e page (VMs of 1, 4 or 8
    chips), its v5p page (4 chips per host); GKE's pods ask for the same chips each."""
    tpu = tpus.parse_tpu_type(tpu_type)
    assert (tpu.hosts, tpu.chips) == (hosts, chips)
    assert tpu.facts.multi_host_source and "xpk" in tpu.facts.multi_host_source
    host = gke.HOSTS[tpu_type]
    assert host.chips * tpu.hosts == tpu.chips and host.xpk_hosts == tpu.hosts
    assert host.source == tpu.facts.multi_host_source


def test_the_zone_table_says_its_source_and_the_date_it_was_read() -> None:
    assert TABLE["zones_read"] == "2026-11-27"
    assert "us-central1-a" in GENERATIONS["v5p"].zones and "us-west1-c" not in GENERATIONS["v5p"].zones
    assert GENERATIONS["v4"].zones == ("us-central2-b",)
    assert "006059e0" in GENERATIONS["v6e"].zones_source and "read 2026-11-27" in GENERATIONS["v6e"].zones_source


def test_every_reader_takes_its_facts_from_the_table() -> None:
    for generation in GENERATIONS.values():
        per_chip, devices, _ = generation.peak or (None, 1, "")
        for single in generation.single_host_types():
            value, source = peak.peak_tflops("tpu", single, "bfloat16")
            assert value == (None if per_chip is None else per_chip / devices), single
            if per_chip is not None:
                assert source == tpus.source(generation.row["peak"]["source"])
    assert {name: (h.machine_type, h.topology, h.chips) for name, h in gke.HOSTS.items() if name.startswith("tpu7x")} \
        == {"tpu7x-8": ("tpu7x-standard-4t", "2x2x1", 4)}
    assert set(vertex.MACHINES) == {"v5litepod-1", "v5litepod-4", "v5litepod-8", "v3-8", "v2-8"}
    assert tpus.generation_name("v5e-4") == "v5litepod" and tpus.generation_of("v9-8") is None


def _names_as_data(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every constant in `names` that stands in a tuple, list, set, dict key or comparison."""
    found = []
    for node in ast.walk(tree):
        parts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else (
            node.keys if isinstance(node, ast.Dict) else
            node.comparators if isinstance(node, ast.Compare) else [])
        found += [(part.lineno, part.value) for part in parts
                  if isinstance(part, ast.Constant) and part.value in names]
    return found


NAMES = set(GENERATIONS) | {alias for g in GENERATIONS.values() for alias in g.row["aliases"]}


def test_the_generation_is_parsed_in_one_place() -> None:
    """No module but runner/device/tpus.py spells a generation's name as data: a second copy of the names
    drifts from the table."""
    offences = [f"{path.relative_to(REPO)}:{line} {name!r}"
                for path in sorted((REPO / "runner").rglob("*.py")) if path.name != "tpus.py"
                for line, name in _names_as_data(ast.parse(path.read_text()), NAMES)]
    assert offences == []


def test_the_finder_sees_the_forms_the_old_copies_took() -> None:
    source = 'A = ("v5p", "v6e")\nB = {"trillium": "v6e"}\nif g == "v4":\n    pass\nC = "v5e-8 in prose"\n'
    assert [name for _, name in _names_as_data(ast.parse(source), NAMES)] == ["v5p", "v6e", "trillium", "v4"]


# --- zones --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tpu_type, zone", [("v5p-8", "us-west1-c"), ("v5litepod-8", "us-central1-q"),
                                            ("v4-8", "us-central1-a")])
def test_a_zone_that_does_not_offer_the_type_is_refused_with_the_zones_that_do(cloud_spec, tpu_type, zone) -> None:
    result = submit(cloud_spec, "--dry-run", "--zone", zone, tpu_type=tpu_type)
    assert result.returncode == 2, result.stderr
    said = " ".join(result.stderr.split())
    facts = tpus.generation_of(tpu_type)
    assert f"--zone {zone} does not offer {tpu_type}" in said
    assert f"offered in {', '.join(facts.zones)}" in said
    assert "skypilot-org/skypilot-catalog" in said and "read 2026-11-27" in said
    assert result.stdout == "", "nothing printed as a request"


def test_a_zone_that_offers_the_type_passes() -> None:
    for tpu_type, zone in (("v5p-8", "europe-west4-b"), ("v6e-8", "us-east5-b"), ("v4-8", "us-central2-b")):
        tpu_types.check_zone_offers(tpu_types.parse_tpu_type(tpu_type), zone)
    with pytest.raises(SpecError) as refused:
        tpu_types.check_zone_offers(tpu_types.parse_tpu_type("v6e-8"), "europe-west1-b")
    assert refused.value.exit_code == 2


# --- TPU7x ----------------------------------------------------------------------------------------------


def test_tpu7x_runs_on_gke_on_its_4_chip_host_with_no_list_price(cloud_spec) -> None:
    shown = submit(cloud_spec, "--on", "gke", "--dry-run", "--zone", "us-central1-c", tpu_type="tpu7x-8")
    assert shown.returncode == 0, shown.stderr
    pod = yaml.safe_load(shown.stdout.split("\n", 4)[-1])["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    selector = pod["spec"]["nodeSelector"]
    assert (selector["cloud.google.com/gke-tpu-accelerator"], selector["cloud.google.com/gke-tpu-topology"],
            selector["node.kubernetes.io/instance-type"]) == ("tpu7x", "2x2x1", "tpu7x-standard-4t")
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"google.com/tpu": 4}
    assert "price: tpu7x-8: no list price" in shown.stderr and "$" not in shown.stderr


@pytest.mark.parametrize("on", ["tpu-vm", "skypilot", "vertex"])
def test_tpu7x_is_refused_off_gke_with_the_reason(cloud_spec, on) -> None:
    result = submit(cloud_spec, "--on", on, "--dry-run", "--zone", "us-central1-c", tpu_type="tpu7x-8")
    assert result.returncode == 2, result.stderr
    said = " ".join(result.stderr.split())
    assert f"--tpu-type tpu7x-8 cannot run --on {'vertex' if on == 'vertex' else 'tpu-vm or skypilot'}" in said
    assert ("run it with --on gke" in said) if on != "vertex" else ("GKE or Compute Engine" in said)



def test_docs_tpu_md_shows_the_tables_runtimes_peaks_and_zones_source() -> None:
    doc = (REPO / "docs" / "tpu.md").read_text()
    for name, generation in GENERATIONS.items():
        row = next((line for line in doc.splitlines() if line.startswith(f"| {name} | ")), None)
        assert row is not None, f"docs/tpu.md has no row for {name}"
        version = generation.runtime("jax")[0]
        assert (f"`{version}`" if version else "none: no Cloud TPU API") in row, row
        assert ", ".join(generation.single_host_types()) in row, row
        multi = [f"{name} ({tpus.parse_tpu_type(name).hosts})" for name in generation.multi_host_types()]
        assert f"| {', '.join(multi) or 'none'} |" in row, row
        peak = generation.peak
        assert (f"{peak[0]} ({peak[1]})" if peak else "none in the table") in row, row
        assert ("no list price" in row) == bool(generation.no_price), row
    assert "006059e0f18a" in doc and f"read {TABLE['zones_read']}" in doc


def test_the_table_and_submit_load_without_tensorflow_or_jax() -> None:
    code = ("import sys, runner.device.tpus, runner.cloud.tpu_types, runner.cloud.pricing, runner.device.peak\n"
            "print(sorted(m for m in ('tensorflow', 'jax', 'keras') if m in sys.modules))")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert ran.returncode == 0 and ran.stdout.strip() == "[]", ran.stderr


@pytest.mark.parametrize(("device_kind", "generation", "tflops"), [
    ("TPU v6 lite", "v6e", 918.0), ("TPU v5 lite", "v5litepod", 197.0), ("TPU v5", "v5p", 459.0)])
def test_a_tpu_job_records_its_generation_from_the_device_kind_and_mfu_finds_its_peak(device_kind, generation,
                                                                                      tflops) -> None:
    """Under JAX the TPU says what it is through its device kind (the strings JAX's own tpu_info reads); the
    summary's accelerator.tpu keeps it with the submitted type and runtime, and the peak for MFU is found."""
    facts = tpus.device_facts(device_kind, {"RUNNER_TPU_TYPE": "x-16", "RUNNER_TPU_RUNTIME_VERSION": "v2-alpha"})
    assert facts == {"device_kind": device_kind, "generation": generation, "accelerator_type": "x-16",
                     "runtime_version": "v2-alpha"}
    value, source = peak.peak_tflops("tpu", peak.device_detail("tpu", facts), "bfloat16")
    assert value == tflops and source
    unknown = tpus.device_facts("TPU v99", {})
    assert unknown["generation"] is None and unknown["accelerator_type"] is None
    assert peak.peak_tflops("tpu", peak.device_detail("tpu", unknown), "bfloat16")[0] is None
