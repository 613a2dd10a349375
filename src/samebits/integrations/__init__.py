"""Callbacks for the trainers users already have: record a run without writing a loop.

    from samebits.integrations.hf import SamebitsCallback          # transformers.Trainer
    from samebits.integrations.lightning import SamebitsCallback   # lightning.Trainer

Both record, per optimizer step and per rank, the metrics (loss, learning rate, gradient norm)
and the digests of parameters, gradients and optimizer state into a samebits run directory,
numbering steps by optimizer steps (gradient accumulation counts once) and continuing the
numbering and the stream when training resumes from a checkpoint.  The Lightning callback also
puts every random state into the checkpoint, so that a resumed run is bitwise exact.  Each
module imports its trainer library; this package imports neither.  See docs/integrations.md.
"""
