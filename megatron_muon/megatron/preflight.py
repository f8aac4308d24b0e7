"""The whole command line checked before torchrun starts a process: one line per mistake.

Inside a job a bad flag costs about 15 s (torchrun, imports, Megatron's setup) and prints about
100 lines from every rank, ending in torchrun's ``ChildFailedError`` banner. The launchers
(``scripts/run.sh main``, ``scripts/slurm/*.sbatch``) run this first, in one process, with the
world size the job will have::

    python -m megatron_muon.megatron.preflight --nproc 16 [--lines | --null] CONFIG.yaml [EXTRA ARGS...]

It does what the job's first seconds do, with nothing distributed: the YAML config becomes
flags (``yaml_config``), Megatron's real parser parses them with megatron-muon's flags
(``hooks.install``), and Megatron's ``validate_args`` runs through the plugin's hook as rank 0
of ``--nproc`` ranks — so every ``--muon-*`` value, every unsupported combination
(``startup_checks``), Megatron's own checks and the values it lets through that fail later, the
``--load`` directory, the ``--save`` directory (a probe file written and removed) and the data
files are checked. On success it prints the argument list (shell-quoted on one line, one per line
with ``--lines``, as ``yaml_config`` does, or each ended by a NUL byte with ``--null``, which keeps an
empty argument and one holding a newline: what ``scripts/run.sh main`` reads with ``mapfile -d ''``)
and exits 0; otherwise it prints
``megatron-muon: error: <one line>`` on stderr and exits 2. Megatron's own output during the
check (its argument dump, warnings) is discarded.

The job checks everything again on its own (the hooks run there too), so a run started
without the launchers is exactly as safe, only slower to fail.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shlex
import sys
import warnings

from .errors import EXIT_CODE, UserInputError, one_line

__all__ = ["check_command_line", "main"]

USAGE = ("usage: python -m megatron_muon.megatron.preflight --nproc N [--lines | --null] [--resume-from-save] "
         "CONFIG.yaml [EXTRA ARGS...]\n"
         "Checks the job's command line as Megatron's rank 0 of N would, then prints its arguments\n"
         "(shell-quoted; --lines: one per line; --null: each ended by a NUL byte).\n"
         "--resume-from-save appends --load <the --save dir> (the sbatch scripts' requeue).")


def check_command_line(config: str, extra_args: list[str], world_size: int, *,
                       resume_from_save: bool = False) -> list[str]:
    """The job's argument list (``config``'s flags, then ``extra_args``, then with
    ``resume_from_save`` ``--load`` the last ``--save``), parsed and validated as rank 0 of
    ``world_size`` would; raises ``UserInputError`` or ``ValueError`` (one line)."""
    saved = sys.argv, os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    os.environ["RANK"], os.environ["WORLD_SIZE"] = "0", str(world_size)
    sink = io.StringIO()  # Megatron's import warnings, argument dump and notes: not the user's answer
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            # torch's own log handler holds the real stderr (bound when torch was imported).
            logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
            from .yaml_config import load_yaml_args

            argv = load_yaml_args(config) + list(extra_args)
            saves = [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == "--save"]
            if resume_from_save and saves:
                argv += ["--load", saves[-1]]
            sys.argv = ["pretrain_gpt.py", *argv]
            _parse_and_validate()
        return argv
    except SystemExit as stop:  # argparse (through hooks' one-line parser error): its line is in the sink
        said = [line for line in sink.getvalue().splitlines() if line.startswith("megatron-muon: error: ")]
        raise UserInputError(said[-1].removeprefix("megatron-muon: error: ") if said
                             else f"the command line was rejected (exit code {stop.code})") from None
    finally:
        sys.argv = saved[0]
        for key, value in (("RANK", saved[1]), ("WORLD_SIZE", saved[2])):
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _parse_and_validate() -> None:
    """What ``parse_and_validate_args`` does before it sets Megatron's global state."""
    import torch

    from . import hooks

    hooks.install()
    from .resume_config import preflight_mode

    if not torch.cuda.is_available():
        from .cpu_patches import apply_cpu_patches

        apply_cpu_patches()  # validate_args asks torch.cuda, as in the job's entry point
    from megatron.training import arguments

    args = arguments.parse_args()
    defaults = {"tokenizer_type": "GPT2BPETokenizer"}  # scripts/pretrain_gpt.py's args_defaults
    if args.yaml_cfg is not None:
        from megatron.training import yaml_arguments

        yaml_arguments.validate_yaml(args, defaults)
    with preflight_mode():
        arguments.validate_args(args, defaults)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else EXIT_CODE
    lines = null = resume = False
    world_size = None
    while argv and argv[0] in ("--lines", "--null", "--nproc", "--resume-from-save"):
        flag = argv.pop(0)
        if flag == "--lines":
            lines = True
        elif flag == "--null":
            null = True
        elif flag == "--resume-from-save":
            resume = True
        else:
            value = argv.pop(0) if argv else ""
            if not value.isdigit() or int(value) < 1:
                print(f"megatron-muon: error: --nproc: expected the job's world size (an integer >= 1), "
                      f"got {value!r}", file=sys.stderr)
                return EXIT_CODE
            world_size = int(value)
    if world_size is None or not argv:
        print(USAGE, file=sys.stderr)
        return EXIT_CODE
    try:
        job_args = check_command_line(argv[0], argv[1:], world_size, resume_from_save=resume)
    except (UserInputError, ValueError, OSError) as err:
        print(f"megatron-muon: error: {one_line(err)}", file=sys.stderr)
        return EXIT_CODE
    if null:
        sys.stdout.write("".join(f"{arg}\0" for arg in job_args))
    else:
        print("\n".join(job_args) if lines else shlex.join(job_args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
