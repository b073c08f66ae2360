"""Every command a generated TensorFlow project documents runs: test_documented_commands.py's check.

A file of its own so that the suite's workers (one file each) run the two frameworks' shapes side
by side: together they are the suite's longest file.

Cost: over 6% of the suite's CPU (docs/testing.md): 8 shapes, each a generated project with every
documented command run (about 6 horovodrun jobs and `make test`, a pytest that trains the project
again), each TensorFlow rank tracing its Keras steps afresh. Each command is a different thing a
user types; the ones that only add shape-independent options run once per framework, not per shape.
"""

import pytest

from test_documented_commands import every_documented_command_runs, shape_id, shapes_of

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("framework, strategy, extra", shapes_of("tensorflow"), ids=map(shape_id, shapes_of("tensorflow")))
def test_every_documented_command_runs_for_tensorflow(tmp_path, framework, strategy, extra):
    every_documented_command_runs(tmp_path, framework, strategy, extra)
