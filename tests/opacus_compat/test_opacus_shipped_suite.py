"""Opacus' own shipped tests (``opacus/tests/``, installed with opacus) run against the drop-in.

A user switching imports gets ``private_engine.opacus_compat.PrivacyEngine`` wherever Opacus'
tests use ``opacus.PrivacyEngine``: the pytest plugin ``opacus_suite_plugin.py`` (this folder)
replaces ``opacus.PrivacyEngine`` and ``opacus.privacy_engine.PrivacyEngine`` before the test
modules are imported, runs torch on one thread with a hypothesis profile of few examples, and
deselects the tests of its ``EXCLUDED`` table (each with its reason: Opacus internals such as
``p.grad_sample``, or a refusal for a privacy or exactness reason).

The suite runs in a subprocess (``python -m pytest`` on the installed files, JUnit XML report):
this test fails when any test that is not excluded fails or errors, or when too few ran.

* default (CI, a few minutes on one thread): the files that drive ``PrivacyEngine`` end to end,
  ``privacy_engine_test.py`` restricted to a few of its model classes, 2 hypothesis examples;
* ``PE_OPACUS_SUITE=full``: every file that uses ``PrivacyEngine`` (CUDA / multi-GPU tests skip
  themselves without GPUs), every model class, 5 hypothesis examples.
"""
from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

opacus = pytest.importorskip("opacus")
pytest.importorskip("hypothesis")
pytest.importorskip("torchvision")
pytest.importorskip("opt_einsum")

HERE = Path(__file__).resolve().parent
SUITE = Path(opacus.__file__).resolve().parent / "tests"
FULL = os.environ.get("PE_OPACUS_SUITE", "") == "full"

#: files that drive a PrivacyEngine end to end (run in every mode)
CORE_FILES = ["privacy_engine_validation_test.py", "gradient_accumulation_test.py",
              "batch_memory_manager_test.py", "randomness_test.py",
              "accounting_noise_multiplier_test.py", "schedulers", "privacy_engine_test.py"]
#: more files of the full run: the rest that imports PrivacyEngine (GPU-only tests skip there),
#: and the data-loader / Poisson tests the drop-in's loaders build on
FULL_FILES = ["mixed_precision_test.py", "multigpu_adaptive_clipping_test.py",
              "multigpu_gradcheck_test.py", "multigpu_precision_test.py",
              "multidevice_optimizer_test.py", "poisson_test.py", "distributed_poisson_test.py",
              "dpdataloader_test.py"]
#: privacy_engine_test.py model classes of the default run (the full run takes all of them)
DEFAULT_CLASSES = ["PrivacyEngineConvNetTest", "PrivacyEngineConvNetFrozenHooksTest",
                   "PrivacyEngineTextTest", "PrivacyEngineTiedWeightsTest",
                   "PrivacyEngineCustomLayerTest"]
#: at least this many tests must pass (a run that collects nothing must not look green)
MIN_PASSED = 250 if FULL else 120


def _outcomes(report: Path):
    """``{test id: "passed" | "failed" | "error" | "skipped"}`` from a JUnit XML report."""
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        out[name] = ("failed" if "failure" in kinds else "error" if "error" in kinds
                     else "skipped" if "skipped" in kinds else "passed")
    return out


@pytest.mark.slow
def test_opacus_shipped_tests_pass_on_the_drop_in(tmp_path):
    files = [str(SUITE / f) for f in CORE_FILES + (FULL_FILES if FULL else [])]
    args = [sys.executable, "-m", "pytest", "-p", "opacus_suite_plugin", "-p", "no:cacheprovider",
            "-c", os.devnull, "--rootdir", str(SUITE), "-q", "-rfE",
            f"--junitxml={tmp_path / 'report.xml'}", *files]
    if not FULL:
        tests = " or ".join(DEFAULT_CLASSES)
        args += ["-k", f"not privacy_engine_test or {tests}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH",
                                                                                   "")]),
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PE_OPACUS_SUITE_ENGINE="dropin",
               PE_OPACUS_SUITE_EXAMPLES="5" if FULL else "2")
    env.pop("PE_OPACUS_SUITE_EXCLUDE", None)
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=3000 if FULL else 900)
    report = tmp_path / "report.xml"
    assert report.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    outcomes = _outcomes(report)
    bad = sorted(n for n, o in outcomes.items() if o in ("failed", "error"))
    passed = sum(o == "passed" for o in outcomes.values())
    assert not bad, (f"{len(bad)} of Opacus' shipped tests fail on the drop-in:\n  "
                     + "\n  ".join(bad) + "\n" + proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert passed >= MIN_PASSED, f"only {passed} tests passed:\n{proc.stdout[-4000:]}"
