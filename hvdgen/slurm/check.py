"""`hvdgen slurm --check`: a hand-edited batch script's directives and launch against the project's layout.

What it reads is what sbatch reads: the `#SBATCH` lines before the script's first command, and
the command that starts the ranks (horovodrun, or srun with an MPI plugin). Each problem is one
line naming the script's line, what is wrong, and the fix.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from hvdgen.slurm.layout import ranks_per_node
from hvdgen.slurm.options import MPI_PLUGINS, SlurmOptions, time_limit_s
from hvdgen.spec import ProjectSpec

SCRIPT = "slurm/train.sbatch"
_SHORT = {"-N": "nodes", "-n": "ntasks", "-G": "gpus", "-t": "time", "-o": "output", "-p": "partition",
          "-A": "account", "-J": "job-name"}
_FLAGS = {"requeue", "no-requeue", "no-kill", "exclusive"}  # directives that take no value


@dataclass(frozen=True)
class Problem:
    where: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: {self.message}" if self.line else f"{self.where}: {self.message}"


@dataclass
class Script:
    """What sbatch and the script's launch line say, with the line each came from."""

    directives: dict[str, tuple[str, int]]
    launch: tuple[list[str], int] | None
    traps_usr1: bool


def read_script(text: str) -> Script:
    directives: dict[str, tuple[str, int]] = {}
    commands_began = False
    launch = None
    traps_usr1 = False
    for number, line in _logical_lines(text):
        stripped = line.strip()
        if not commands_began and stripped.startswith("#SBATCH"):
            for name, value in _options(stripped[len("#SBATCH"):].split("#", 1)[0]):
                directives[name] = (value, number)
            continue
        if not stripped or stripped.startswith("#"):
            continue
        commands_began = True  # sbatch reads no directive after the first command
        if re.search(r"\btrap\b.*\bUSR1\b", stripped):
            traps_usr1 = True
        words = _words(stripped)
        for i, word in enumerate(words):
            program = word.split("(")[-1].rsplit("/", 1)[-1]  # also inside an array: launch=(srun ...
            if program in ("horovodrun", "srun") and launch is None and _launches(words[i:]):
                launch = ([program, *words[i + 1:]], number)
                break
    return Script(directives, launch, traps_usr1)


def _logical_lines(text: str):
    """(first line's number, line) with continuations joined: a trailing backslash, or an array
    whose parentheses close on a later line."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        number, line = i + 1, lines[i]
        while i + 1 < len(lines) and not line.lstrip().startswith("#") and (
                line.endswith("\\") or line.count("(") > line.count(")")):
            i += 1
            line = line.removesuffix("\\") + " " + lines[i]
        yield number, line
        i += 1


def _words(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return line.split()


def _launches(words: list[str]) -> bool:
    """A launch starts the training script, not a helper (srun hostname)."""
    return any(w.endswith("train.py") for w in words)


def _options(text: str):
    words = _words(text)
    i = 0
    while i < len(words):
        word = words[i]
        if word.startswith("--"):
            name, _, value = word[2:].partition("=")
            if not value and name not in _FLAGS and i + 1 < len(words) and not words[i + 1].startswith("-"):
                value, i = words[i + 1], i + 1
            yield name, value
        elif word[:2] in _SHORT:
            value = word[2:]
            if not value and i + 1 < len(words):
                value, i = words[i + 1], i + 1
            yield _SHORT[word[:2]], value
        i += 1


def check_script(text: str, spec: ProjectSpec, where: str, project: Path, mpi_built: bool | None) -> list[Problem]:
    """Every problem of the script against `spec`; `mpi_built` is whether the Horovod here has MPI
    (None: no Horovod here to ask)."""
    script = read_script(text)
    d = script.directives
    problems: list[Problem] = []

    def problem(key: str | int, message: str) -> None:
        line = key if isinstance(key, int) else d.get(key, ("", 0))[1]
        problems.append(Problem(where, line, message))

    nodes = _count(d, "nodes", problem)
    per_node = _count(d, "ntasks-per-node", problem)
    gpus = _gpus(d, problem)
    if nodes is None and "nodes" not in d:
        problem(0, "no #SBATCH --nodes: the job's size is the cluster's default, not the project's; add e.g. "
                   "#SBATCH --nodes=2")
    if per_node is None and "ntasks-per-node" not in d:
        problem(0, "no #SBATCH --ntasks-per-node: the launch places that many ranks on each node; add e.g. "
                   "#SBATCH --ntasks-per-node=4 (one per GPU)")
    if nodes and per_node:
        for key, message in layout_problems(spec, nodes, per_node, gpus):
            problem(key, message)
        ntasks = _count(d, "ntasks", problem)
        if ntasks and ntasks != nodes * per_node:
            problem("ntasks", f"--ntasks={ntasks} is not --nodes {nodes} x --ntasks-per-node {per_node} = "
                              f"{nodes * per_node}: drop --ntasks (the other two make it)")
    _check_signal(script, problem)
    _check_output(d, project, problem)
    _check_launch(script, spec, nodes, per_node, mpi_built, problem)
    return problems


def _count(d: dict, key: str, problem) -> int | None:
    if key not in d:
        return None
    value = d[key][0]
    if not re.fullmatch(r"[1-9]\d*", value):
        problem(key, f"--{key}={value} is not a whole number of at least 1: e.g. --{key}=2")
        return None
    return int(value)


def _gpus(d: dict, problem) -> int | None:
    """GPUs per node from --gpus-per-node=[type:]N or --gres=gpu[:type]:N."""
    if "gpus-per-node" in d:
        value = d["gpus-per-node"][0].rsplit(":", 1)[-1]
    elif "gres" in d and d["gres"][0].startswith("gpu"):
        value = d["gres"][0].rsplit(":", 1)[-1] if ":" in d["gres"][0] else "1"
    else:
        return None
    if not value.isdigit():
        problem("gpus-per-node" if "gpus-per-node" in d else "gres", f"cannot read a GPU count from {value!r}: "
                "write e.g. --gpus-per-node=4")
        return None
    return int(value)


def layout_problems(spec: ProjectSpec, nodes: int, per_node: int, gpus: int | None) -> list[tuple[str, str]]:
    """(directive, problem) for each way `nodes` x `per_node` ranks with `gpus` GPUs a node do not fit
    the project's layout (also what `hvdgen doctor` says of an allocation)."""
    found = []
    if gpus:
        wanted = ranks_per_node(spec, SlurmOptions(nodes=nodes, gpus_per_node=gpus))
        if per_node != wanted:
            each = f"{spec.stages} GPUs a rank, one per stage" if spec.strategy == "model-split" else "one rank per GPU"
            found.append(("ntasks-per-node", f"--ntasks-per-node={per_node} with {gpus} GPUs a node: {spec.strategy} "
                                             f"runs {each}, so write --ntasks-per-node={wanted}"))
    if spec.tp > 1 and per_node % spec.tp:
        found.append(("ntasks-per-node", f"--ntasks-per-node={per_node} splits tensor-parallel groups of tp {spec.tp} "
                                         "over nodes (they exchange activations in every layer): use a multiple of "
                                         f"{spec.tp}"))
    world = nodes * per_node
    if world % spec.model_ranks:
        what = (f"{spec.stages} stages" + (f" x tp {spec.tp}" if spec.tp > 1 else "")
                if spec.strategy == "pipeline" else f"tp {spec.tp}")
        found.append(("nodes", f"--nodes={nodes} x --ntasks-per-node={per_node} is {world} ranks, not whole copies of "
                               f"the model ({what}): change --nodes or --ntasks-per-node so their product is a "
                               f"multiple of {spec.model_ranks}"))
    return found


def _check_signal(script: Script, problem) -> None:
    d = script.directives
    signal = d.get("signal", ("", 0))[0]
    if script.traps_usr1:
        if not signal:
            problem(0, "the script stops at a checkpoint on USR1 but nothing sends it before the time limit: add "
                       "#SBATCH --signal=B:USR1@120")
        elif not signal.startswith("B:"):
            problem("signal", f"--signal={signal} signals the job's steps, not this script, whose trap stops the "
                              f"ranks and requeues: write --signal=B:{signal}")
        elif not re.fullmatch(r"B:(SIG)?USR1(@\d+)?", signal):
            problem("signal", f"--signal={signal} sends another signal than the USR1 the script traps: write "
                              "--signal=B:USR1@120")
        if "requeue" not in d or "no-requeue" in d:
            problem("no-requeue" if "no-requeue" in d else 0,
                    "the script requeues itself on USR1, but the job is not requeueable: add #SBATCH --requeue")
        elif d.get("open-mode", ("", 0))[0] != "append":
            problem("requeue", "a requeued start would truncate the job's output file: add #SBATCH --open-mode=append")
    if "time" in d and signal:
        lead = re.search(r"@(\d+)$", signal)
        limit = time_limit_s(d["time"][0])
        if limit is None:
            problem("time", f"--time={d['time'][0]} is not a Slurm time limit: use minutes, HH:MM:SS or D-HH:MM:SS")
        elif lead and int(lead.group(1)) >= limit:
            problem("signal", f"--signal={signal} comes {lead.group(1)} s before a --time of {limit} s: the job would "
                              "stop before it trains; lower the lead or raise --time")


def _check_output(d: dict, project: Path, problem) -> None:
    """Slurm opens the output file in a folder that must exist; a job whose folder is missing
    fails before its first line, without a word."""
    for key in ("output", "error"):
        if key in d:
            folder = Path(d[key][0]).parent
            if "%" not in str(folder) and not (folder if folder.is_absolute() else project / folder).is_dir():
                problem(key, f"--{key}={d[key][0]}: the folder {folder} does not exist, and Slurm would fail the job "
                             f"without a word: create it (mkdir -p {folder})")


def _check_launch(script: Script, spec: ProjectSpec, nodes: int | None, per_node: int | None,
                  mpi_built: bool | None, problem) -> None:
    if script.launch is None:
        problem(0, "no line starts the ranks (horovodrun ... train.py, or srun --mpi=pmix ... train.py): restore "
                   f"the launch of {SCRIPT} (hvdgen slurm writes it again)")
        return
    words, line = script.launch
    if words[0].rsplit("/", 1)[-1] == "srun":
        plugin = next((w.split("=", 1)[1] for w in words if w.startswith("--mpi=")), None)
        if plugin is None and "--mpi" in words[:-1]:
            plugin = words[words.index("--mpi") + 1]
        if plugin in (None, "none"):
            problem(line, "srun starts the ranks without an MPI plugin, so each would train alone as rank 0 of 1: "
                          "write srun --mpi=pmix (or pmi2)")
        elif plugin.split("_")[0] not in MPI_PLUGINS:
            problem(line, f"srun --mpi={plugin} is not an MPI plugin Horovod's OpenMPI reads: use --mpi=pmix or pmi2")
        if spec.elastic:
            problem(line, "an elastic project needs horovodrun's elastic launch (Gloo); srun has none: restore the "
                          "horovodrun line (hvdgen slurm --controller gloo)")
        if mpi_built is False:
            problem(line, "srun --mpi starts MPI ranks, but the Horovod here was built without MPI: install OpenMPI "
                          "and run hvdgen install-horovod --force, or launch with horovodrun --gloo")
        return
    if "-np" in words[:-1] and nodes and per_node:
        np_ = words[words.index("-np") + 1]
        if np_.isdigit() and int(np_) != nodes * per_node:
            problem(line, f"horovodrun -np {np_} is not the job's --nodes {nodes} x --ntasks-per-node {per_node}: "
                          'write -np "$SLURM_NTASKS"')


def mpi_built() -> bool | None:
    """Whether the installed Horovod has the MPI controller: its framework libraries then link
    libmpi (asking Horovod itself would import a framework, seconds for a check of a text file).
    None where no Horovod is installed."""
    found = importlib.util.find_spec("horovod")
    if found is None or not found.submodule_search_locations:
        return None
    libraries = [path for folder in found.submodule_search_locations for path in Path(folder).glob("*/mpi_lib*.so")]
    return any(b"libmpi.so" in path.read_bytes() for path in libraries) if libraries else None
