"""`hvdgen new` asks in a real terminal: tmux runs it, keys are typed, the screen is read.

Enter takes each default; a bad answer is asked again with the reason the flag would get;
questions follow the strategy chosen; Ctrl-C leaves the folder as it was; any option, --no-input,
or input that is not a terminal means no question at all.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="Requires: tmux (apt-get install tmux)")


class Terminal:
    """One tmux session running a command in `cwd`, 100 columns wide, on a tmux server of its own
    (its own socket, no configuration file): a developer's own tmux server, its settings and the
    signal state it started with stay out of the test."""

    def __init__(self, command: list[str], cwd: Path):
        self.tmux = ["tmux", "-L", f"hvdgen-{uuid.uuid4().hex[:8]}", "-f", "/dev/null"]
        shell_line = " ".join(command) + "; echo EXIT=$?; sleep 30"
        subprocess.run([*self.tmux, "new-session", "-d", "-s", "test", "-x", "100", "-y", "50", "-c", str(cwd),
                        shell_line], check=True)

    def screen(self) -> str:
        return subprocess.run([*self.tmux, "capture-pane", "-p", "-t", "test", "-S", "-50"], capture_output=True,
                              text=True, check=True).stdout

    def wait_for(self, text: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            shown = self.screen()
            if text in shown:
                return shown
            time.sleep(0.1)
        raise AssertionError(f"{text!r} never appeared:\n{self.screen()}")

    def answer(self, prompt: str, keys: str | None = None) -> None:
        """Wait for the prompt's last line, then type keys (None: only Enter)."""
        self.wait_for(prompt)
        if keys is not None:
            subprocess.run([*self.tmux, "send-keys", "-t", "test", "-l", keys], check=True)
        subprocess.run([*self.tmux, "send-keys", "-t", "test", "Enter"], check=True)

    def press(self, key: str) -> None:
        subprocess.run([*self.tmux, "send-keys", "-t", "test", key], check=True)

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], capture_output=True)


@pytest.fixture
def terminal():
    opened = []

    def open_terminal(*args: str, cwd: Path) -> Terminal:
        t = Terminal([sys.executable, "-m", "hvdgen", "new", *args], cwd)
        opened.append(t)
        return t

    yield open_terminal
    for t in opened:
        t.close()


def answers_of(project: Path) -> dict:
    return yaml.safe_load((project / ".hvdgen.yaml").read_text())


def test_enter_takes_every_default(tmp_path, terminal):
    t = terminal(cwd=tmp_path)
    t.answer("Project name:", "first")
    for prompt in ("Framework (torch, tensorflow) [torch]:", "Strategy (data, model-split, pipeline, tensor) [data]:",
                   "Model (mlp, resnet18, gpt) [mlp]:",
                   "Elastic (survive lost workers, rescale to the hosts found)? [y/N]:"):
        t.answer(prompt)
    shown = t.wait_for("EXIT=")
    assert "EXIT=0" in shown and "created first (torch, data, mlp" in shown, shown
    spec = answers_of(tmp_path / "first")
    assert (spec["framework"], spec["strategy"], spec["model"], spec["elastic"]) == ("torch", "data", "mlp", False)


def test_a_bad_answer_is_asked_again_with_the_reason(tmp_path, terminal):
    """The name given, so not asked; a framework that does not exist, and stages the model cannot
    hold (refused as --stages would be, with the answers before it), are each asked again."""
    t = terminal("deep", cwd=tmp_path)
    t.answer("Framework (torch, tensorflow) [torch]:", "jax")
    t.wait_for("Error: 'jax' is not one of 'torch', 'tensorflow'.")
    t.answer("Framework (torch, tensorflow) [torch]:", "tensorflow")
    t.answer("[data]:", "pipeline")
    t.answer("Model (mlp, resnet18, gpt) [mlp]:")
    t.answer("Stages [2]:", "9")
    t.wait_for("Error: --stages 9 is more than the 4 blocks of the generated mlp")
    t.answer("Stages [2]:", "3")
    t.answer("Micro-batches per batch [4]:", "8")
    t.answer("Schedule (gpipe, 1f1b, interleaved-1f1b) [1f1b]:", "gpipe")    # TensorFlow: zb-h1 is not offered
    shown = t.wait_for("EXIT=")
    assert "EXIT=0" in shown and "Elastic" not in shown, shown     # a pipeline cannot be elastic: not asked
    spec = answers_of(tmp_path / "deep")
    assert (spec["framework"], spec["strategy"], spec["stages"], spec["micro_batches"], spec["schedule"]) == \
        ("tensorflow", "pipeline", 3, 8, "gpipe")


def test_the_tensor_strategy_asks_for_tp_and_offers_only_the_models_it_splits(tmp_path, terminal):
    t = terminal("wide", cwd=tmp_path)
    t.answer("[torch]:")
    t.answer("[data]:", "tensor")
    t.answer("Model (gpt) [gpt]:")
    t.answer("Ranks per tensor-parallel group (tp) [2]:", "3")
    t.wait_for("Error: ")              # 3 does not divide the GPT's 4 heads: the flag's own reason
    t.answer("Ranks per tensor-parallel group (tp) [2]:", "4")
    shown = t.wait_for("EXIT=")
    assert "EXIT=0" in shown, shown
    assert (answers_of(tmp_path / "wide")["strategy"], answers_of(tmp_path / "wide")["tp"]) == ("tensor", 4)


def test_ctrl_c_leaves_nothing(tmp_path, terminal):
    (tmp_path / "mine.txt").write_text("the user's")
    t = terminal(cwd=tmp_path)
    t.answer("Project name:", "gone")
    t.answer("[torch]:")
    t.wait_for("Strategy (")
    t.press("C-c")
    shown = t.wait_for("EXIT=")
    assert "EXIT=1" in shown and "Aborted!" in shown, shown
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]


def _started_without_job_control():
    """As a shell without job control starts a background job (`nohup ./scripts/test.sh &`), and
    as some CI runners start theirs: SIGINT ignored, and blocked too."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def test_ctrl_c_reaches_hvdgen_however_the_suite_was_started(tmp_path):
    """The Ctrl-C test, in a pytest session started with SIGINT ignored and blocked: tests/conftest.py
    gives every process the suite starts a terminal's signal state, tmux's server and its pane too."""
    ctrl_c = f"{Path(__file__)}::test_ctrl_c_leaves_nothing"
    session = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                              "--timeout", "60", "--basetemp", str(tmp_path / "base"), ctrl_c],
                             preexec_fn=_started_without_job_control, capture_output=True, text=True, timeout=120)
    assert session.returncode == 0 and "1 passed" in session.stdout, session.stdout[-3000:]


@pytest.mark.parametrize("args", [["quiet", "--no-input"], ["quiet", "--framework", "torch"]],
                         ids=["no-input", "an-option"])
def test_no_questions_with_an_option_or_no_input(tmp_path, terminal, args):
    t = terminal(*args, cwd=tmp_path)
    shown = t.wait_for("EXIT=")
    assert "EXIT=0" in shown and "created quiet (torch, data, mlp" in shown and "[torch]:" not in shown, shown


def test_no_questions_off_a_terminal(tmp_path):
    """Piped input (a script, CI): the defaults, and without a name, the one-line usage error."""
    run = [str(Path(sys.executable).with_name("hvdgen")), "new"]
    made = subprocess.run([*run, "piped"], cwd=tmp_path, input="tensorflow\n", capture_output=True, text=True)
    assert made.returncode == 0 and answers_of(tmp_path / "piped")["framework"] == "torch", made.stderr
    nameless = subprocess.run(run, cwd=tmp_path, input="", capture_output=True, text=True)
    assert nameless.returncode == 2
    assert nameless.stderr.strip() == ("Error: Missing argument 'NAME': e.g. hvdgen new myproject "
                                       "(see hvdgen new --help)")
