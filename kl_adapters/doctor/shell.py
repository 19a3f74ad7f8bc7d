"""Read the arguments a launch script passes to a Python module, without running the script.

Handles what launch scripts of verl and OpenRLHF use: line continuations, comments, ``NAME=value`` / ``export NAME=..``
assignments (also ``NAME=${NAME:-default}``, and ``VAR=value python ...`` prefixes), bash arrays ``NAME=( ... )`` and
``NAME+=( ... )`` expanded by ``"${NAME[@]}"``, ``$NAME`` / ``${NAME}`` / ``${NAME:-default}`` / ``${NAME:=default}`` in
arguments (an unquoted variable holding several words splits into several arguments), integer arithmetic ``$((...))``,
``case WORD in pattern) ... ;; esac`` (only the first matching branch applies), and pipes / redirections after the
command (not arguments). What cannot be resolved without running the script (an unset variable, ``$(...)``, ``$1``) becomes the
word `marker` (UNRESOLVED_...) and is listed in `Command.unresolved`; ``$@`` / ``$*`` (the script's own arguments)
are dropped and listed. Control flow is not otherwise followed (if / for / functions): every assignment is applied in
file order, the last one before the command wins.
Pinned by tests/core/test_doctor.py::test_shell_*.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .report import DoctorError

#: what an unresolved reference is replaced by: a plain word (Hydra and argparse accept it), naming what it was
UNRESOLVED = "UNRESOLVED_"


def marker(reference: str) -> str:
    """The word standing for an unresolved reference, e.g. UNRESOLVED_HOME for $HOME."""
    return UNRESOLVED + (re.sub(r"\W+", "_", reference).strip("_") or "value")


_ASSIGN = re.compile(r"^(?:export\s+|declare\s+(?:-\w+\s+)*|local\s+)?([A-Za-z_]\w*)=(.*)$", re.S)
_LABEL = re.compile(r"^\s*([^\s()]+)\)\s*")  # a case branch label: "pattern)" or "a|b)"
_ARRAY_START = re.compile(r"^\s*(?:[^\s()]+\)\s*)?(?:export\s+|declare\s+-a\s+)?([A-Za-z_]\w*)(\+?)=\((.*)$", re.S)
_REF = re.compile(r"\$\{([A-Za-z_]\w*)(\[[@*]\])?(?:(:?[-=])([^}]*))?\}|\$([A-Za-z_]\w*)|\$([@*#?0-9])|\$\(\(?[^)]*\)?\)|`[^`]*`|\$\{[^}]*\}")


@dataclass
class Command:
    """One invocation of the module: its arguments after ``-m <module>`` (or the module's file), expanded."""

    module: str
    args: list[str]
    line: int  # 1-based line of the script where the command starts
    unresolved: list[str] = field(default_factory=list)
    #: variables (assigned or exported in the script, or given) at the command, e.g. KL_ADAPTERS
    variables: dict[str, str] = field(default_factory=dict)


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each logical line: backslash continuations joined, arrays kept whole."""
    out: list[tuple[int, str]] = []
    buf, start, depth = "", 0, 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf:
            start = number
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        if depth == 0 and _ARRAY_START.match(buf) and ")" not in _strip_comment(buf.split("=(", 1)[1]):
            depth = 1
        elif depth and ")" in _strip_comment(line):
            depth = 0
        if depth:
            buf += "\n"
            continue
        out.append((start, buf))
        buf = ""
    if buf:
        out.append((start, buf))
    return out


def _strip_comment(text: str) -> str:
    try:
        return " ".join(shlex.split(text, comments=True))
    except ValueError:
        return text


def _expand(token: str, env: Mapping[str, str], arrays: Mapping[str, list[str]], unresolved: list[str]) -> list[str]:
    """Expand one (unquoted) word; a whole-word array reference splices its elements."""
    whole = re.fullmatch(r"\$\{([A-Za-z_]\w*)\[[@*]\]\}", token)
    if whole and whole.group(1) in arrays:
        return [e for item in arrays[whole.group(1)] for e in _expand(item, env, arrays, unresolved)]
    single = re.fullmatch(r"\$\{?([A-Za-z_]\w*)\}?", token)
    if single and single.group(1) in env and len(env[single.group(1)].split()) > 1:
        return env[single.group(1)].split()  # word splitting of a variable holding several arguments
    if token in ("$@", "$*"):
        unresolved.append(f"{token} (the script's own arguments, dropped)")
        return []

    def sub(m: re.Match) -> str:
        name, index, op, default, plain, special = m.groups()
        name = name or plain
        if name is None:  # $1, $#, $(...), `...`
            unresolved.append(m.group(0))
            return marker(m.group(0))
        if index is not None and name in arrays:
            return " ".join(arrays[name])
        if name in env and (env[name] != "" or op not in (":-", ":=")):
            return env[name]
        if op is not None:
            return " ".join(_expand(default, env, arrays, unresolved))
        unresolved.append(f"${name}")
        return marker(name)

    return [_REF.sub(sub, token)]


def _words(text: str, variables: Mapping[str, str] | None = None) -> list[str] | None:
    """Shell words of a line, up to the first pipe, redirection or command separator. Arithmetic $((...)) is
    evaluated when its variables are known integers; any other $(...) / `...` becomes one `marker` word."""
    try:
        words = shlex.split(_substitute(text, variables or {}), comments=True)
    except ValueError:
        return None
    end = next((i for i, w in enumerate(words) if _OPERATOR.match(w)), len(words))
    return words[:end]


_OPERATOR = re.compile(r"^(\|\|?|&&?|;|\d*>>?|\d*>&|<)")


def _substitute(text: str, variables: Mapping[str, str]) -> str:
    out, i = [], 0
    while i < len(text):
        if text.startswith("$(", i):
            depth, j = 0, i + 1
            while j < len(text):
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                if depth == 0:
                    break
                j += 1
            body = text[i:j + 1]
            out.append(_arithmetic(body[3:-2], variables) if body.startswith("$((") else marker(body))
            i = j + 1
        elif text[i] == "`" and "`" in text[i + 1:]:
            j = text.index("`", i + 1)
            out.append(marker(text[i:j + 1]))
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


_ARITHMETIC = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
               ast.Div: lambda a, b: a // b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}


def _arithmetic(expression: str, variables: Mapping[str, str]) -> str:
    """bash integer arithmetic (+ - * / %, parentheses, variables), or a marker when it uses anything else."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and re.fullmatch(r"-?\d+", variables.get(node.id, "")):
            return int(variables[node.id])
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            return _ARITHMETIC[type(node.op)](value(node.left), value(node.right))
        raise ValueError(ast.dump(node))

    try:
        return str(value(ast.parse(re.sub(r"\$\{?(\w+)\}?", r"\1", expression).strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError):
        return marker(f"$(({expression}))")


def find_commands(text: str, modules: tuple[str, ...], env: Mapping[str, str] | None = None) -> list[Command]:
    """Every invocation of one of `modules` in the shell script `text` (``python -m mod`` or ``.../mod/as/path.py``),
    with its arguments expanded using the script's assignments and `env` (the caller's environment)."""
    variables: dict[str, str] = dict(env or {})
    arrays: dict[str, list[str]] = {}
    commands = []
    paths = {m: m.replace(".", "/") + ".py" for m in modules}
    case: list[str] | None = None  # the word of the enclosing `case`, expanded
    active, matched = True, False  # in a branch that applies; a branch of this case has applied
    for number, line in logical_lines(text):
        head = _words(line.split(")", 1)[0] if _LABEL.match(line) else line, variables) or [""]
        if head[0] == "case" and len(head) >= 3:
            case, active, matched = [" ".join(_expand(head[1], variables, arrays, []))], False, False
            continue
        if head[0] == "esac":
            case, active = None, True
            continue
        if case is not None:
            label = _LABEL.match(line)
            if label:
                active = not matched and any(fnmatch.fnmatchcase(case[0], p) for p in label.group(1).split("|"))
                matched = matched or active
                line = line[label.end():]
            if not active:
                continue
            line = re.sub(r"\s*;;\s*$", "", line)
        array = _ARRAY_START.match(line)
        if array and ")" in line.split("=(", 1)[1]:
            inner = line.split("=(", 1)[1].rsplit(")", 1)[0]
            noise: list[str] = []
            elements = [e for w in (_words(inner, variables) or []) for e in _expand(w, variables, arrays, noise)]
            arrays[array.group(1)] = (arrays.get(array.group(1), []) if array.group(2) else []) + elements
            continue
        words = _words(line, variables)
        if not words:
            continue
        module = _module_index(words, modules, paths)
        if module is None:
            for word in words:  # assignments, possibly several (A=1 B=2), possibly a prefix of a command
                m = _ASSIGN.match(word)
                if not m:
                    break
                noise = []
                variables[m.group(1)] = " ".join(_expand(m.group(2), variables, arrays, noise))
            if words[0] == "export" and len(words) > 1:
                for word in words[1:]:
                    m = _ASSIGN.match(word)
                    if m:
                        noise = []
                        variables[m.group(1)] = " ".join(_expand(m.group(2), variables, arrays, noise))
            continue
        name, start = module
        unresolved: list[str] = []
        local = dict(variables)
        for word in words[:start]:  # VAR=value python -m ...  (per-command environment)
            m = _ASSIGN.match(word)
            if m:
                local[m.group(1)] = " ".join(_expand(m.group(2), variables, arrays, unresolved))
        args = [e for w in words[start:] for e in _expand(w, local, arrays, unresolved)]
        named = {marker(u) for u in unresolved} | {marker("$" + u[1:]) for u in unresolved}
        unresolved += [m for a in args for m in re.findall(UNRESOLVED + r"\w+", a) if m not in named]  # via arrays
        commands.append(Command(name, args, number, list(dict.fromkeys(unresolved)), local))
    return commands


def _module_index(words: list[str], modules: tuple[str, ...], paths: dict[str, str]) -> tuple[str, int] | None:
    """(module, index of its first argument) if the words run one of the modules."""
    for i, word in enumerate(words):
        if word == "-m" and i + 1 < len(words) and words[i + 1] in modules:
            return words[i + 1], i + 2
        for module, path in paths.items():
            if word.endswith(path):
                return module, i + 1
    return None


def launch_arguments(argv: list[str], modules: tuple[str, ...], env: Mapping[str, str]) -> Command:
    """argv itself when it is not one ``.sh`` path; else the script's last command running one of `modules`
    (DoctorError when it cannot be read or runs none of them)."""
    if not (len(argv) == 1 and argv[0].endswith(".sh")):
        return Command(modules[0], list(argv), 0)
    try:
        commands = find_commands(Path(argv[0]).read_text(), modules, env)
    except OSError as err:
        raise DoctorError(f"cannot read {argv[0]}: {err}") from None
    if not commands:
        raise DoctorError(f"{argv[0]} does not run {' or '.join(modules)}")
    return commands[-1]
