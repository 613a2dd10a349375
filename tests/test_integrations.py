"""The trainer callbacks (samebits.integrations): recording and exact resume, on tiny models.

Each claim has its failing twin: a resume without the Lightning callback's random states
differs at the resume step, and a mid-epoch resume with a plain data loader is reported as
not exact (and differs).
"""

from __future__ import annotations

import glob

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import samebits
from samebits.verdicts import Verdict

def _steps(run_dir) -> list[int]:
    return [block.step for block in samebits.open_run(run_dir).stream(0).steps()]


def _names(run_dir, step: int) -> set[tuple[str, str]]:
    block = next(b for b in samebits.open_run(run_dir).stream(0).steps() if b.step == step)
    return {(r.phase, r.name) for r in block.records()}


L = pytest.importorskip("lightning", reason="lightning is in the test extra: pip install -e '.[test]'")


# --- Lightning ---------------------------------------------------------------------------
class _Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(out, ckpt_dir, *, max_steps, every, resume_step=None, loader="plain", callback=True, rng=True):
    """32 samples, batches of 4, 2 accumulated per step: 4 optimizer steps per epoch."""
    from samebits.integrations.lightning import SamebitsCallback

    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))
    if loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader as loader_class
    else:
        loader_class = DataLoader
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=every, save_top_k=-1)]
    if callback:
        callbacks.append(SamebitsCallback(out, rng=rng))
    trainer = L.Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, accelerator="cpu", devices=1, accumulate_grad_batches=2)
    ckpt = glob.glob(f"{ckpt_dir}/*step={resume_step}.ckpt")[0] if resume_step is not None else None
    trainer.fit(_Net(), loader_class(data, batch_size=4, shuffle=True), ckpt_path=ckpt)


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory):
    """The uninterrupted 10-step run, one per kind of data loader (made on first use)."""
    root, runs = tmp_path_factory.mktemp("lightning"), {}

    def get(loader: str = "plain"):
        if loader not in runs:
            _fit(root / loader, root / f"{loader}-ck", max_steps=10, every=100, loader=loader)
            runs[loader] = root / loader
        return runs[loader]

    return get


@pytest.fixture
def lightning_full(full_runs):
    return full_runs("plain")


def test_lightning_records_each_optimizer_step_with_full_names(lightning_full):
    assert _steps(lightning_full) == list(range(10))  # 20 micro-batches, 2 per optimizer step
    names = _names(lightning_full, 0)
    assert ("params", "net.0.weight") in names and ("grads", "net.3.bias") in names
    assert ("loss", "microbatch0") in names and ("loss", "microbatch1") in names
    assert ("metrics", "loss") in names and ("metrics", "lr") in names and ("metrics", "grad_norm") in names


@pytest.mark.parametrize("resume_step, loader", [(4, "plain"), (5, "stateful")], ids=["epoch-end", "mid-epoch-stateful"])
def test_lightning_resume_is_exact_with_the_callback(tmp_path, full_runs, resume_step, loader):
    _fit(tmp_path / "save", tmp_path / "ck", max_steps=resume_step, every=resume_step, loader=loader)
    _fit(tmp_path / "resumed", tmp_path / "ck", max_steps=10, every=100, resume_step=resume_step, loader=loader)
    result = samebits.diff(full_runs(loader), tmp_path / "resumed", start_step=resume_step)
    assert result.verdict is Verdict.IDENTICAL
    assert _steps(tmp_path / "resumed") == list(range(resume_step, 10))


def test_lightning_resume_without_random_states_differs_at_the_resume_step(tmp_path, lightning_full):
    _fit(tmp_path / "save", tmp_path / "ck", max_steps=4, every=4, rng=False)
    _fit(tmp_path / "resumed", tmp_path / "ck", max_steps=10, every=100, resume_step=4, rng=False)
    result = samebits.diff(lightning_full, tmp_path / "resumed", start_step=4)
    assert result.verdict is Verdict.DIVERGED and result.divergences[0].step == 4


def test_lightning_mid_epoch_resume_with_a_plain_loader_is_reported_not_exact(tmp_path, lightning_full, capfd):
    _fit(tmp_path / "save", tmp_path / "ck", max_steps=5, every=5)
    _fit(tmp_path / "resumed", tmp_path / "ck", max_steps=10, every=100, resume_step=5)
    assert "this resume cannot be bitwise exact" in capfd.readouterr().err
    assert samebits.diff(lightning_full, tmp_path / "resumed", start_step=5).verdict is Verdict.DIVERGED


# --- Hugging Face Trainer ------------------------------------------------------------------
def _hf_train(out, args_dir, *, max_steps, resume=None, save_steps=3):
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    from samebits.integrations.hf import SamebitsCallback

    transformers.set_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(2)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (24, 12), generator=g)]
    args = transformers.TrainingArguments(
        output_dir=str(args_dir), max_steps=max_steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1e-3, save_steps=save_steps, save_strategy="steps", logging_steps=1, report_to=[],
        use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[SamebitsCallback(out)])
    trainer.train(resume_from_checkpoint=resume)


def test_hf_callback_records_steps_and_resumes_exactly(tmp_path):
    _hf_train(tmp_path / "full", tmp_path / "ta", max_steps=6)
    assert _steps(tmp_path / "full") == list(range(6))
    names = _names(tmp_path / "full", 2)
    assert ("params", "model.layers.0.self_attn.q_proj.weight") in names
    assert ("loss", "microbatch1") in names and ("metrics", "grad_norm") in names
    _hf_train(tmp_path / "resumed", tmp_path / "ta", max_steps=6, resume=str(tmp_path / "ta" / "checkpoint-3"))
    assert _steps(tmp_path / "resumed") == [3, 4, 5]
    assert samebits.diff(tmp_path / "full", tmp_path / "resumed", start_step=3).verdict is Verdict.IDENTICAL
    assert samebits.diff(tmp_path / "full", tmp_path / "resumed", start_step=3).compared["records"] > 0


def test_callbacks_step_aside_under_zero_code_recording(tmp_path, monkeypatch):
    monkeypatch.setenv("SAMEBITS_AUTORECORD", "1")
    from samebits.integrations.lightning import SamebitsCallback

    callback = SamebitsCallback(tmp_path / "x")
    assert callback.steps is None and callback.rng  # records nothing itself, still keeps random states


def test_a_callback_without_a_run_directory_says_what_to_do(monkeypatch):
    from samebits.integrations.hf import SamebitsCallback

    monkeypatch.delenv("SAMEBITS_DIR", raising=False)
    monkeypatch.delenv("SAMEBITS_AUTORECORD", raising=False)
    pytest.importorskip("transformers")
    with pytest.raises(samebits.ConfigError, match="no run directory"):
        SamebitsCallback()


@pytest.mark.slow
@pytest.mark.parametrize("callback", [True, False], ids=["with-callback", "without"])
def test_verify_with_resume_on_a_lightning_script(tmp_path, callback):
    """`samebits verify --resume-with` on a user's Lightning script: PASS with the callback (it
    keeps the random states in the checkpoint), FAIL at the resume step without it."""
    import sys
    from pathlib import Path

    from samebits.runners.program import ZeroCode
    from samebits.runners.verify import verify

    script = str(Path(__file__).parent / "scripts_integrations" / "lightning_train.py")
    extra = [] if callback else ["--no-callback"]
    cmd = [sys.executable, script, "--workdir", "{out}", "--steps", "8", "--save-every", "4", *extra]
    resume = " ".join([sys.executable, script, "--workdir", "{out}", "--steps", "8", *extra,
                       "--resume", "{from}/ckpt/step=4.ckpt"])
    result = verify(ZeroCode(tuple(cmd), tuple(resume.split())), tmp_path / "v", resume_at=4)
    if callback:
        assert result.verdict is Verdict.PASS, result.checks
    else:
        assert result.verdict is Verdict.FAIL
        assert result.checks["independent"].verdict is Verdict.IDENTICAL
        assert result.checks["resume"].divergences[0].step == 4
        # Lightning's checkpoint holds no random state: the torch generator, which the step
        # draws from (dropout, the new epoch's shuffle), is named; nothing else is
        first = result.findings[0]
        assert (first.kind, first.generator, first.step) == ("generator", "torch_cpu", 4), result.findings
        assert all(f.generator not in ("python", "numpy") for f in result.findings)


@pytest.mark.slow
def test_verify_shows_the_lightning_callbacks_own_finding(tmp_path):
    """A mid-epoch resume with a plain loader: the callback knows why it cannot be exact, and
    verify prints that with its verdict, not only in logs/c.log."""
    import sys
    from pathlib import Path

    from samebits.runners.program import ZeroCode
    from samebits.runners.verify import verify

    script = str(Path(__file__).parent / "scripts_integrations" / "lightning_train.py")
    cmd = [sys.executable, script, "--workdir", "{out}", "--steps", "8", "--save-every", "5"]
    resume = " ".join([sys.executable, script, "--workdir", "{out}", "--steps", "8",
                       "--resume", "{from}/ckpt/step=5.ckpt"])
    result = verify(ZeroCode(tuple(cmd), tuple(resume.split())), tmp_path / "v", resume_at=5)
    assert result.verdict is Verdict.FAIL
    said = [f for f in result.findings if f.kind == "script_said"]
    assert said and "the checkpoint was taken in the middle of epoch 1" in said[0].says
    assert any("cannot be bitwise exact" in line for line in result.explanations["resume"])
