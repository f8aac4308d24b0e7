"""YAML experiment configs → Megatron command-line arguments, one key per flag.

A config is a flat YAML mapping; every key is one of Megatron's flags (megatron-muon's
included), spelled as its option string without the dashes (``num_layers`` or ``num-layers`` for
``--num-layers``) or as its argparse ``dest`` (``layernorm_epsilon`` for ``--norm-epsilon``)::

    num_layers: 2                 # --num-layers 2
    swiglu: true                  # --swiglu          (store_true: false leaves it out)
    muon_split_fc1: false         # --muon-no-split-fc1  (a dest: the flag that gives that value)
    disable_bias_linear: true     # --disable-bias-linear (the flag itself: true = pass it)
    train_data_path: [a, b]       # --train-data-path a b  (nargs)
    tokenizer_model: null         # left out: Megatron's default

Every key and value is checked against the real parser (Megatron's ``add_megatron_arguments``
plus ``add_muon_args``): an unknown key, a value of the wrong type, a value outside the flag's
choices, a list for a one-value flag, or two keys for the same setting is a ``ValueError`` naming
the key and the file. The result is an argument list, so Megatron's own ``parse_args`` /
``validate_args`` still see an ordinary command line (unlike Megatron's experimental
``--yaml-cfg``, which bypasses ``validate_args`` and which ``--optimizer muon`` refuses).

Command line (the arguments, shell-quoted, on one line; EXTRA ARGS come last, so they win)::

    python -m megatron_muon.megatron.yaml_config CONFIG.yaml [EXTRA ARGS...]

YAML is read with PyYAML's safe loader (a dependency), refusing a repeated key.
"""

from __future__ import annotations

import argparse
import functools
import shlex
import sys
from pathlib import Path

import yaml

__all__ = ["build_parser", "load_yaml_args", "args_from_mapping", "read_yaml", "main"]

_FLAG_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)


@functools.lru_cache(maxsize=1)
def build_parser() -> argparse.ArgumentParser:
    """Megatron's full parser (as ``parse_args`` builds it) plus megatron-muon's flags."""
    from megatron.training import arguments

    from .cli import add_muon_args

    # add_muon_args is idempotent, so this is right whether or not install() has run.
    return add_muon_args(arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))


# --------------------------------------------------------------------------- reading YAML


def read_yaml(path: str | Path) -> dict:
    """The top-level mapping of a YAML file; ``ValueError`` (naming the file) for anything else."""
    path = Path(path)
    data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader(path))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config must be a mapping of flag names to values, got {type(data).__name__}")
    return data


def _UniqueKeyLoader(path: Path):
    """PyYAML's SafeLoader, refusing a repeated key (PyYAML would silently keep the last)."""

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise ValueError(f"{path}: key {key!r} appears twice")
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return Loader


def _by_dest(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    out: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            out.setdefault(action.dest, []).append(action)
    return out


def _is_flag(action: argparse.Action) -> bool:
    return isinstance(action, (*_FLAG_ACTIONS, argparse.BooleanOptionalAction))


def _flag_args(key: str, value, actions: list[argparse.Action], where: str) -> list[str]:
    """The flag(s) that set ``actions[0].dest`` to the boolean ``value``."""
    if not isinstance(value, bool):
        raise ValueError(f"{where}: key {key!r} is an on/off flag; expected true or false, got {value!r}")
    for action in actions:
        if isinstance(action, argparse.BooleanOptionalAction):
            positive = [s for s in action.option_strings if not s.startswith("--no-")]
            negative = [s for s in action.option_strings if s.startswith("--no-")]
            return [positive[0] if value else negative[0]]
    for action in actions:
        if isinstance(action, _FLAG_ACTIONS) and action.const is value:
            return [action.option_strings[0]]
    if bool(actions[0].default) == value:  # no flag gives it, and nothing needs to: the default
        return []
    raise ValueError(f"{where}: key {key!r} cannot be {str(value).lower()}: no flag of "
                     f"{actions[0].dest!r} sets that (its default is {actions[0].default!r})")


def _value_args(key: str, value, action: argparse.Action, where: str) -> list[str]:
    option = action.option_strings[0]
    items = value if isinstance(value, list) else [value]
    if isinstance(value, list):
        if action.nargs in (None, "?"):
            raise ValueError(f"{where}: key {key!r} ({option}) takes one value, got a list")
        if isinstance(action.nargs, int) and len(value) != action.nargs:
            raise ValueError(f"{where}: key {key!r} ({option}) takes {action.nargs} values, got {len(value)}")
        if action.nargs == "+" and not value:
            raise ValueError(f"{where}: key {key!r} ({option}) needs at least one value")
    expected = getattr(action.type, "__name__", "str") if isinstance(action.type, type) else "value"
    words = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            shown = str(item).lower() if isinstance(item, bool) else repr(item)
            raise ValueError(f"{where}: key {key!r} ({option}) expects a {expected}, got {shown}")
        word = str(item)
        converted = word
        if action.type is not None:
            try:
                converted = action.type(word)
            except Exception as err:  # noqa: BLE001 (argparse type functions raise anything)
                raise ValueError(f"{where}: key {key!r} ({option}) expects a {expected}, got {item!r}") from err
        if action.choices is not None and converted not in action.choices:
            choices = ", ".join(str(getattr(c, "name", c)) for c in action.choices)
            raise ValueError(f"{where}: key {key!r} ({option}) must be one of {choices}; got {item!r}")
        words.append(word)
    return [option, *words]


def args_from_mapping(data: dict, source: str = "<config>",
                      parser: argparse.ArgumentParser | None = None) -> list[str]:
    """The argument list a config mapping describes; ``ValueError`` names a bad key and ``source``."""
    parser = parser or build_parser()
    options, by_dest = parser._option_string_actions, _by_dest(parser)
    argv: list[str] = []
    seen: dict[str, str] = {}  # dest → the key that set it
    for raw_key, value in data.items():
        if not isinstance(raw_key, str):
            raise ValueError(f"{source}: key {raw_key!r} is not a flag name")
        key = raw_key.replace("-", "_")
        option = "--" + key.replace("_", "-")
        action = options.get(option)
        if action is None and key not in by_dest:
            raise ValueError(f"{source}: unknown key {raw_key!r}: no Megatron or megatron-muon flag "
                             f"{option} (nor an option whose dest is {key!r})")
        if isinstance(action, argparse._HelpAction):
            raise ValueError(f"{source}: key {raw_key!r} is not a setting")
        dest = action.dest if action is not None else key
        if dest in seen:
            raise ValueError(f"{source}: keys {seen[dest]!r} and {raw_key!r} both set {dest!r}")
        seen[dest] = raw_key
        if value is None:  # null: the flag's default
            continue
        if action is not None and _is_flag(action) and action.dest != key:
            # The key names the flag itself (disable_bias_linear, muon_no_split_qkv): true = pass it.
            if not isinstance(value, bool):
                raise ValueError(f"{source}: key {raw_key!r} is an on/off flag; expected true or false, got {value!r}")
            if value:
                argv.append(option)
            continue
        actions = [action] if action is not None and not _is_flag(action) else by_dest[dest]
        if _is_flag(actions[0]):
            argv += _flag_args(raw_key, value, actions, source)
        else:
            argv += _value_args(raw_key, value, actions[0], source)
    return argv


def load_yaml_args(path: str | Path) -> list[str]:
    """The Megatron argument list of the YAML config at ``path`` (validated against the parser)."""
    return args_from_mapping(read_yaml(path), str(path))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    lines = bool(argv) and argv[0] == "--lines"  # one argument per line, for `mapfile` in scripts
    if lines:
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m megatron_muon.megatron.yaml_config [--lines] CONFIG.yaml [EXTRA ARGS...]\n"
              "Prints the config's Megatron arguments, shell-quoted (or one per line), then EXTRA ARGS.",
              file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    try:
        args = load_yaml_args(argv[0])
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print("\n".join(args + argv[1:]) if lines else shlex.join(args + argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
