"""Run litgpt's own CLI (`litgpt ...`, litgpt.__main__.main) in this process, after an optional planted fault.

    python launch.py [--fault NAME] pretrain --config pretrain.yaml --out_dir OUT [--resume CKPT] [litgpt options]

is `litgpt pretrain --config pretrain.yaml ...` with this folder on the import path (for
`--data synthetic_data.SyntheticTokens`), 2 CPU threads, the model eager (below) and, with
`--fault NAME`, one fault from faults.py applied first.  Everything after the options here goes
to litgpt unchanged.
"""
import os
import sys

# litgpt's pretrain always wraps the model in torch.compile.  On CPU its compiled (inductor) model is
# not repeatable run to run: two plain runs of this config, without samebits, ended with 24 of 26
# parameter tensors different at step 4, while eager runs are bit-identical.  So the corpus runs the
# model eager (dynamo disabled before torch is imported); TORCHDYNAMO_DISABLE=0 compiles as shipped.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import faults  # noqa: E402


def main():
    argv = sys.argv[1:]
    if argv[:1] == ["--fault"]:
        if len(argv) < 2 or argv[1] not in faults.FAULTS:
            sys.exit(f"launch.py: --fault takes one of {', '.join(sorted(faults.FAULTS))}")
        argv = faults.FAULTS[argv[1]](argv[2:])
    import torch

    torch.set_num_threads(2)  # as every corpus program: 2 CPU threads, whatever the machine has
    sys.argv = ["litgpt", *argv]  # litgpt re-parses sys.argv when it saves a checkpoint's hyperparameters
    from litgpt.__main__ import main as litgpt_main

    litgpt_main()


if __name__ == "__main__":
    main()
