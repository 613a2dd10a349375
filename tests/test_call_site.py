"""An op's call site is the innermost frame of the program: an installed trainer's own file
(torchtitan's, whose folder name starts with "torch") is the program's, torch's and the
standard library's frames are not (issue 33)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import samebits
from samebits import _torchutil
from samebits.trace import TraceConfig, attach


def _traced_sites(directory, forward) -> dict[str, str]:
    """One step of a model whose forward is ``forward``, traced at rung 3 with call sites:
    {op id: call site} of step 0."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = forward

        def forward(self, x):
            return self.inner(x)

    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = samebits.Recorder(directory, rank=0, world_size=1)
    tracer = attach(model, recorder, TraceConfig(level=3, call_sites=True))
    try:
        with tracer.step(0):
            loss = model(torch.randn(3, 8, generator=torch.Generator().manual_seed(0))).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            recorder.end_step(0)
    finally:
        tracer.close()
        recorder.close()
    sites = json.loads((directory / "trace-rank-00000.json").read_text())["steps"]["0"]
    return {key.partition("|")[2]: site for key, site in sites.items()}


@pytest.mark.slow  # torchtitan comes with the realcode extra, which .ci/run installs before the slow set
def test_an_installed_trainer_whose_name_starts_with_torch_is_the_program(tmp_path):
    # torchtitan's SwiGLU feed-forward: `F.silu(self.w1(x)) * self.w3(x)` at its own line.
    pytest.importorskip("torchtitan", reason="pip install -e '.[realcode]' (CI installs it for the slow set)")
    from torchtitan.models.common import feed_forward
    from torchtitan.models.common.linear import Linear

    torch.manual_seed(0)
    ffn = feed_forward.FeedForward(feed_forward.FeedForward.Config(
        w1=Linear.Config(in_features=8, out_features=16), w2=Linear.Config(in_features=16, out_features=8),
        w3=Linear.Config(in_features=8, out_features=16)))
    sites = _traced_sites(tmp_path / "run", ffn)
    silu = next(site for op, site in sites.items() if op.endswith("aten::silu:0") and "backward" not in op)
    # Before: every frame under site-packages/torch* was taken for torch's own, so the site
    # was this test's line calling the model (or a launcher's `runpy` line).
    assert silu.startswith(feed_forward.__file__) and silu.endswith("in forward"), silu


class _Copying(torch.nn.Linear):
    def forward(self, x):
        # its copy_ runs in torch's Tensor.__deepcopy__, which copy.py calls
        return super().forward(x) * copy.deepcopy(self.weight.detach()).sum()


def test_standard_library_frames_are_not_the_program(tmp_path):
    sites = _traced_sites(tmp_path / "run", _Copying(8, 8))
    clone = next(site for op, site in sites.items() if "aten::copy_" in op and "backward" not in op)
    assert clone.startswith(__file__) and clone.endswith("in forward"), clone  # before: copy.py's line


def test_a_package_folder_inside_the_standard_librarys_folder_is_the_program():
    stdlib = _torchutil._STDLIB_DIRS[0]
    assert _torchutil._library_file(stdlib + "runpy.py")
    assert not _torchutil._library_file(stdlib + "site-packages/torchtitan/train.py")
    assert _torchutil._library_file(_torchutil.TORCH_DIR + "/nn/modules/module.py")
    assert not _torchutil._library_file(_torchutil.TORCH_DIR + "titan/models/common/decoder.py")
