"""YAML experiment configs → Megatron command-line arguments, one key per flag.

A config is a flat YAML mapping; every key is one of Megatron's flags (megatron-muon's
included), spelled as its option string without the dashes (``num_layers`` or ``num-layers`` for
``--num-layers``) or as its argparse ``dest`` (``layernorm_epsilon`` for ``--norm-epsilon``)::

    num_layers: 2                 # --num-layers 2
    swiglu: true                  # --swiglu          (store_true: false leaves it out)
    muon_split_fc1: false         # --muon-no-split-fc1  (a dest: the flag that gives that value)
    disable_bias_linear: true     # --disable-bias-linear (the flag itself: true = pass it)
    train_data_path: [a, b]       # --train-data-path a b  (nargs)

Every key and value is checked against the real parser (Megatron's ``add_megatron_arguments``
plus ``add_muon_args``): an unknown key, a value of the wrong type, a value outside the flag's
choices, a list for a one-value flag, a null (leave the key out for the flag's default), or two
keys for the same setting is a ``ValueError`` naming the key and the file. The result is an
argument list, so Megatron's own ``parse_args`` / ``validate_args`` still see an ordinary command
line (unlike Megatron's experimental ``--yaml-cfg``, which bypasses ``validate_args`` and which
``--optimizer muon`` refuses).

Command line (the arguments, shell-quoted, on one line; EXTRA ARGS come last, so they win)::

    python -m megatron_muon.megatron.yaml_config CONFIG.yaml [EXTRA ARGS...]

A bad config exits 2 with exactly one line on stderr, ``error: PATH[:LINE[:COLUMN]]: problem``.

YAML is read with PyYAML's safe loader (a dependency), refusing a repeated key.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import shlex
import sys
from collections.abc import Hashable
from pathlib import Path

import yaml

__all__ = ["build_parser", "load_yaml_args", "args_from_mapping", "read_yaml", "read_yaml_with_lines", "main"]

_FLAG_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)


def build_parser() -> argparse.ArgumentParser:
    """Megatron's full parser (as ``parse_args`` builds it) plus megatron-muon's flags (``cli.full_parser``)."""
    from .cli import full_parser

    return full_parser()


# --------------------------------------------------------------------------- reading YAML


def read_yaml(path: str | Path) -> dict:
    """The top-level mapping of a YAML file; ``ValueError`` (one line, naming the file) for anything else."""
    return read_yaml_with_lines(path)[0]


def read_yaml_with_lines(path: str | Path) -> tuple[dict, dict]:
    """``(mapping, key_lines)``: the file's top-level mapping and the 1-based line of each of its keys.

    Every failure is a one-line ``ValueError`` starting with the path (``PATH:LINE:COLUMN:`` where
    the YAML reader knows the place): a missing or unreadable file, text that is not UTF-8, a YAML
    syntax error, a repeated key, an empty file (or only comments), or a top level that is not a
    mapping. An empty file (or ``{}``) is refused because it gives an empty argument list, which
    scripts/run.sh's ``mapfile <<<`` turns into one empty argument (Megatron: ``unrecognized
    arguments: `` with nothing after it).
    """
    path = Path(path)
    text = _read_text(path)
    try:
        data, key_lines = _load_with_key_lines(text, _UniqueKeyLoader(path))
    except yaml.MarkedYAMLError as err:
        raise ValueError(_marked_error_line(path, err)) from None
    except yaml.reader.ReaderError as err:
        line, column = _line_and_column(text, err.position)
        raise ValueError(f"{path}:{line}:{column}: unacceptable character #x{err.character:04x}: "
                         f"{err.reason}") from None
    except yaml.YAMLError as err:  # no other kind in PyYAML 6; kept so nothing escapes as a traceback
        raise ValueError(f"{path}: " + " ".join(str(err).split())) from None
    if data is None or data == {}:
        raise ValueError(f"{path}: empty config; expected a mapping of flag names to values")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config must be a mapping of flag names to values, got {type(data).__name__}")
    return data, key_lines


def _load_with_key_lines(text: str, loader_class) -> tuple[object, dict]:
    """The document in ``text`` and, if it is a mapping, the 1-based line of each scalar key."""
    loader = loader_class(text)  # raises ReaderError here already for a non-printable character
    try:
        root = loader.get_single_node()
        data = None if root is None else loader.construct_document(root)
        key_lines = {}
        if isinstance(root, yaml.MappingNode):
            key_lines = {loader.construct_object(key_node): key_node.start_mark.line + 1
                         for key_node, _ in root.value if isinstance(key_node, yaml.ScalarNode)}
        return data, key_lines
    finally:
        loader.dispose()


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such config file") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a directory; expected a YAML config file") from None
    except UnicodeDecodeError as err:
        line = err.object.count(b"\n", 0, err.start) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte 0x{err.object[err.start]:02x}: {err.reason})") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot read the config file: {err.strerror}") from None


def _line_and_column(text: str, position: int) -> tuple[int, int]:
    """1-based line and column of character ``position`` of ``text``."""
    line_start = text.rfind("\n", 0, position) + 1
    return text.count("\n", 0, position) + 1, position - line_start + 1


def _marked_error_line(path: Path, err: yaml.MarkedYAMLError) -> str:
    """``PATH:LINE:COLUMN: problem (context at line N)``; PyYAML's marks are 0-based."""
    mark = err.problem_mark or err.context_mark
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    text = err.problem or err.context or "invalid YAML"
    if err.problem and err.context:
        context_at = f" at line {err.context_mark.line + 1}" if err.context_mark is not None else ""
        text += f" ({err.context}{context_at})"
    return f"{where}: " + " ".join(text.split())


def _UniqueKeyLoader(path: Path):
    """PyYAML's SafeLoader, refusing a repeated key (PyYAML would silently keep the last)."""

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            first_line: dict = {}  # key → the 1-based line it first appeared on
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, Hashable):  # SafeLoader's own error ("found unhashable key") follows
                    continue
                mark = key_node.start_mark
                if key in first_line:
                    raise ValueError(f"{path}:{mark.line + 1}:{mark.column + 1}: key {key!r} appears twice "
                                     f"(first at line {first_line[key]})")
                first_line[key] = mark.line + 1
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
    type_name = getattr(action.type, "__name__", "str") if isinstance(action.type, type) else "value"
    expected = f"an {type_name}" if type_name[0] in "aeiou" else f"a {type_name}"
    words = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            shown = str(item).lower() if isinstance(item, bool) else repr(item)
            raise ValueError(f"{where}: key {key!r} ({option}) expects {expected}, got {shown}")
        word = str(item)
        converted = word
        if action.type is not None:
            try:
                converted = action.type(word)
            except Exception as err:  # noqa: BLE001 (argparse type functions raise anything)
                raise ValueError(f"{where}: key {key!r} ({option}) expects {expected}, got {item!r}") from err
        if action.choices is not None and converted not in action.choices:
            choices = ", ".join(str(getattr(c, "name", c)) for c in action.choices)
            raise ValueError(f"{where}: key {key!r} ({option}) must be one of {choices}; got {item!r}")
        words.append(word)
    return [option, *words]


def args_from_mapping(data: dict, source: str = "<config>", parser: argparse.ArgumentParser | None = None,
                      key_lines: dict | None = None) -> list[str]:
    """The argument list a config mapping describes; ``ValueError`` names a bad key and ``source``.

    With ``key_lines`` (key → 1-based line, from ``read_yaml_with_lines``) an error about a key says
    ``SOURCE:LINE:`` instead of ``SOURCE:``.
    """
    parser = parser or build_parser()
    options, by_dest = parser._option_string_actions, _by_dest(parser)
    argv: list[str] = []
    seen: dict[str, str] = {}  # dest → the key that set it
    for raw_key, value in data.items():
        where = f"{source}:{key_lines[raw_key]}" if key_lines and raw_key in key_lines else source
        if not isinstance(raw_key, str):
            raise ValueError(f"{where}: key {raw_key!r} is not a flag name")
        key = raw_key.replace("-", "_")
        option = "--" + key.replace("_", "-")
        action = options.get(option)
        if action is None and key not in by_dest:
            raise ValueError(f"{where}: unknown key {raw_key!r}: no Megatron or megatron-muon flag "
                             f"{option} (nor an option whose dest is {key!r})")
        if isinstance(action, argparse._HelpAction):
            raise ValueError(f"{where}: key {raw_key!r} is not a setting")
        dest = action.dest if action is not None else key
        if dest in seen:
            raise ValueError(f"{where}: keys {seen[dest]!r} and {raw_key!r} both set {dest!r}")
        seen[dest] = raw_key
        if value is None:
            # Leaving a key out gives the flag's default; a null would too, silently: for a flag with no
            # default (lr) that is a traceback at the optimizer build on every rank, and for any key
            # it hides whether the value was meant to be filled in.
            shown = option if action is not None else by_dest[dest][0].option_strings[0]
            wanted = ("true or false" if _is_flag(action if action is not None else by_dest[dest][0])
                      else "a value")
            raise ValueError(f"{where}: key {raw_key!r} ({shown}) is null; expected {wanted} (leave the key out "
                             "for the flag's default)")
        if action is not None and _is_flag(action) and action.dest != key:
            # The key names the flag itself (disable_bias_linear, muon_no_split_qkv): true = pass it.
            if not isinstance(value, bool):
                raise ValueError(f"{where}: key {raw_key!r} is an on/off flag; expected true or false, got {value!r}")
            if value:
                argv.append(option)
            continue
        actions = [action] if action is not None and not _is_flag(action) else by_dest[dest]
        if _is_flag(actions[0]):
            argv += _flag_args(raw_key, value, actions, where)
        else:
            argv += _value_args(raw_key, value, actions[0], where)
    return argv


def load_yaml_args(path: str | Path) -> list[str]:
    """The Megatron argument list of the YAML config at ``path`` (validated against the parser)."""
    data, key_lines = read_yaml_with_lines(path)
    return args_from_mapping(data, str(path), key_lines=key_lines)


@contextlib.contextmanager
def _import_noise_held_back(sink: io.StringIO):
    """Importing megatron-core (to build the parser) warns about Transformer Engine, Apex and CUDA,
    through ``warnings`` and through torch's logging (whose handler holds the real stderr); both
    are held back so that a config error is the only line on stderr."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stderr(sink):
            yield
    finally:
        logging.disable(previous)


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
    import_noise = io.StringIO()
    try:
        with _import_noise_held_back(import_noise):
            args = load_yaml_args(argv[0])
    except ValueError as err:  # every config problem; exit 2 = usage/config error, as argparse does
        print("error: " + " ".join(str(err).splitlines()), file=sys.stderr)
        return 2
    except BaseException:
        sys.stderr.write(import_noise.getvalue())  # an unexpected failure: show everything
        raise
    print("\n".join(args + argv[1:]) if lines else shlex.join(args + argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
