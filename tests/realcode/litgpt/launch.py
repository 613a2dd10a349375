"""Run litgpt's own CLI (`litgpt ...`, litgpt.__main__.main) in this process, after an optional planted fault.

    python launch.py [--fault NAME] pretrain --config pretrain.yaml --out_dir OUT [--resume CKPT] [litgpt options]

is `litgpt pretrain --config pretrain.yaml ...` with this folder on the import path (for
`--data synthetic_data.SyntheticTokens`) and, with `--fault NAME`, one fault from faults.py
applied first.  Everything after the options here goes to litgpt unchanged.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import faults  # noqa: E402


def main():
    argv = sys.argv[1:]
    if argv[:1] == ["--fault"]:
        if len(argv) < 2 or argv[1] not in faults.FAULTS:
            sys.exit(f"launch.py: --fault takes one of {', '.join(sorted(faults.FAULTS))}")
        argv = faults.FAULTS[argv[1]](argv[2:])
    sys.argv = ["litgpt", *argv]  # litgpt re-parses sys.argv when it saves a checkpoint's hyperparameters
    from litgpt.__main__ import main as litgpt_main

    litgpt_main()


if __name__ == "__main__":
    main()
