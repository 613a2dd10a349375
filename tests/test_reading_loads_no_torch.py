"""Reading a run loads no torch: `samebits show` and `samebits dump` of a small run take well
under a second, not the 5-6 s of importing torch (issue 35 item 8).

The stream reader decodes a metric's bits with `struct` (bfloat16 as the top half of a
float32) and takes the dtype codes and sizes from `samebits.fingerprint._codes`, plain data;
`samebits.stream` and `samebits.fingerprint` import their torch-using modules on first use.
These tests check what is imported (in a fresh interpreter) and that the torch-free decoding
and tables agree with torch's, not the time (benchmarks/RESULTS.md has the times).
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
import torch

from conftest import write_run
from samebits.fingerprint import DTYPE_CODES
from samebits.fingerprint._codes import DTYPE_CODE_BY_NAME, ITEMSIZE_BY_NAME
from samebits.stream._records import _STRUCT_FORMATS, Record


def test_show_and_dump_import_no_torch(tmp_path):
    run = tmp_path / "run"
    write_run(run, world_size=2, num_steps=3)
    script = f"""
import contextlib, io, json, sys
from samebits.cli import main
codes = []
for argv in (["show", {str(run)!r}], ["show", {str(run)!r}, "--records", "--json"], ["dump", {str(run)!r}, "--step", "1"],
             ["dump", {str(run)!r}, "--rank", "1", "--json"]):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        codes.append(main(argv))
print(json.dumps({{"codes": codes, "torch": "torch" in sys.modules, "last": out.getvalue()}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["codes"] == [0, 0, 0, 0]
    assert not found["torch"], "show/dump imported torch"
    metrics = [r for step in json.loads(found["last"]) for r in step["records"] if r["kind"] == "metric"]
    assert {r["name"]: r["value"] for r in metrics if r["name"] == "grad_norm"} == {"grad_norm": 1.5}


def test_the_dtype_tables_agree_with_torch():
    for name, code in DTYPE_CODE_BY_NAME.items():
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            assert DTYPE_CODES[dtype] == code
            assert ITEMSIZE_BY_NAME[name] == dtype.itemsize, name
    assert set(ITEMSIZE_BY_NAME) == set(DTYPE_CODE_BY_NAME)


@pytest.mark.parametrize("dtype", [*_STRUCT_FORMATS, "bfloat16", "float8_e4m3fn"])
def test_a_metric_decodes_without_torch_to_what_torch_reads(dtype):
    values = torch.tensor([0.0, -1.5, 3.140625, 65504.0, 1e-3, 1e30], dtype=torch.float64)
    if dtype == "bool":
        values = values != 0
    for value in values.to(getattr(torch, dtype)):
        raw = value.reshape(1).view(torch.uint8).numpy().tobytes()
        record = Record("metric", "metrics", "x", 0, dtype, None, 0, None, raw)
        assert record.value == value.item() or (value.isnan() and record.value != record.value), (dtype, value)
        if dtype in _STRUCT_FORMATS:
            assert isinstance(record.value, type(value.item()))
            assert struct.calcsize(_STRUCT_FORMATS[dtype]) == len(raw)
