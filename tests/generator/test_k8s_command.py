"""`hvdgen k8s`: re-renders k8s/ from the project's answers and touches nothing else; `--check`
rejects hand-edited manifests with one line per problem."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from hvdgen.cli import main
from hvdgen.overwrite import FINGERPRINTS
from hvdgen.spec import SPEC_FILE


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


@pytest.fixture
def project(tmp_path) -> Path:
    result = run("new", "demo", "--output", str(tmp_path))
    assert result.exit_code == 0, result.output
    return tmp_path / "demo"


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def answers(project: Path) -> dict:
    return yaml.safe_load((project / SPEC_FILE).read_text())


def test_new_writes_valid_k8s(project):
    assert (project / "k8s" / "base" / "mpijob.yaml").is_file()
    result = run("k8s", "--project", str(project), "--check")
    assert result.exit_code == 0, result.output


def test_rerender_touches_only_k8s_and_the_k8s_answers(project):
    (project / "train.py").write_text((project / "train.py").read_text() + "\n# my change\n")
    (project / "notes.md").write_text("mine\n")
    (project / "config.yaml").write_text((project / "config.yaml").read_text().replace("epochs: 20", "epochs: 3"))
    before = snapshot(project)
    spec_before = answers(project)

    result = run("k8s", "--project", str(project), "--workers", "4", "--gpus-per-worker", "2", "--elastic",
                 "--max-workers", "6", "--image", "registry.example.com/ml/demo:v3", "--namespace", "ml")
    assert result.exit_code == 0, result.output

    after = snapshot(project)
    changed = {rel for rel in before.keys() | after.keys() if before.get(rel) != after.get(rel)}
    # .hvdgen-files.yaml: the new k8s files are recorded as hvdgen's own (see hvdgen/overwrite.py)
    assert changed and all(rel.startswith("k8s/") or rel in (SPEC_FILE, FINGERPRINTS) for rel in changed), changed
    spec_after = answers(project)
    assert {k: v for k, v in spec_after.items() if k != "k8s"} == {k: v for k, v in spec_before.items() if k != "k8s"}
    assert spec_after["k8s"]["workers"] == 4 and spec_after["k8s"]["elastic"] is True
    assert not list(project.glob(".hvdgen-k8s-*")), "staging folder left behind"

    job = yaml.safe_load((project / "k8s/base/mpijob.yaml").read_text())
    assert job["metadata"]["namespace"] == "ml"
    assert job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == 4
    patch = yaml.safe_load((project / "k8s/overlays/gpu/mpijob-patch.yaml").read_text())
    assert patch["spec"]["slotsPerWorker"] == 2

    # Options left out keep the recorded answers.
    result = run("k8s", "--project", str(project), "--workers", "3")
    assert result.exit_code == 0, result.output
    k8s = answers(project)["k8s"]
    assert (k8s["workers"], k8s["image"], k8s["max_workers"], k8s["namespace"]) == (
        3, "registry.example.com/ml/demo:v3", 6, "ml")
    assert run("k8s", "--project", str(project), "--check").exit_code == 0


def test_gpus_zero_drops_the_gpu_overlay(project):
    assert (project / "k8s/overlays/gpu").is_dir()
    assert run("k8s", "--project", str(project), "--gpus-per-worker", "0").exit_code == 0
    assert not (project / "k8s/overlays/gpu").exists()
    assert run("k8s", "--project", str(project), "--check").exit_code == 0


@pytest.mark.parametrize("args,words", [
    (["--workers", "0"], ["--workers", "between 1 and 1024"]),
    (["--elastic", "--min-workers", "3", "--workers", "2"], ["--min-workers", "<= --workers"]),
    (["--namespace", "ML_Team"], ["--namespace", "lower-case"]),
    (["--image", "Bad Image"], ["--image", "image reference"]),
])
def test_bad_options_change_nothing(project, args, words):
    before = snapshot(project)
    result = run("k8s", "--project", str(project), *args)
    assert result.exit_code == 1
    line = result.output.strip()
    assert "\n" not in line and all(word in line for word in words), line
    assert snapshot(project) == before


def test_check_rejects_a_hand_edited_manifest(project):
    path = project / "k8s/base/mpijob.yaml"
    path.write_text(path.read_text().replace("              limits:", "              limit:", 1))
    result = run("k8s", "--project", str(project), "--check")
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert lines == ["k8s/base: spec.mpiReplicaSpecs.Launcher.template.spec.containers[0].resources: "
                     "unknown field 'limit': did you mean 'limits'?"]


def test_check_reports_a_broken_patch_under_its_overlay(project):
    path = project / "k8s/overlays/gpu/mpijob-patch.yaml"
    path.write_text(path.read_text().replace("\nspec:\n", "\nspec:\n  slotsPerWorker: -2\n", 1))
    result = run("k8s", "--project", str(project), "--check")
    assert result.exit_code == 1
    assert result.output.strip().startswith("k8s/overlays/gpu: spec.slotsPerWorker: is -2, must not be negative")


def test_check_reads_a_file_from_stdin(project):
    job = yaml.safe_load((project / "k8s/base/mpijob.yaml").read_text())
    job["spec"]["mpiReplicaSpecs"]["Launcher"]["replicas"] = 2
    result = run("k8s", "--check", "--file", "-", input=yaml.safe_dump(job))
    assert result.exit_code == 1
    assert result.output.strip() == ("<stdin>: spec.mpiReplicaSpecs.Launcher.replicas: is 2, must be exactly 1: "
                                     "set replicas: 1")
    job["spec"]["mpiReplicaSpecs"]["Launcher"]["replicas"] = 1
    assert run("k8s", "--check", "--file", "-", input=yaml.safe_dump(job)).exit_code == 0


def test_outside_a_project(tmp_path):
    result = run("k8s", "--project", str(tmp_path))
    assert result.exit_code == 1 and ".hvdgen.yaml" in result.output


def test_check_names_a_file_that_is_not_yaml(project):
    (project / "k8s/base/checkpoints-pvc.yaml").write_text("apiVersion: v1\nkind: [\n")
    result = run("k8s", "--project", str(project), "--check")
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("k8s/base: ") and "checkpoints-pvc.yaml is not valid YAML" in lines[0]


def test_check_says_how_to_check_what_it_cannot_render(project):
    path = project / "k8s/overlays/cpu/kustomization.yaml"
    path.write_text(path.read_text() + "commonLabels:\n  team: ml\n")
    result = run("k8s", "--project", str(project), "--check")
    assert result.exit_code == 1
    assert "commonLabels" in result.output and "kubectl kustomize" in result.output


def test_pods_run_as_non_root_by_default_and_as_root_when_asked(project):
    def pods(overlay="base/mpijob.yaml"):
        job = yaml.safe_load((project / "k8s" / overlay).read_text())
        specs = job["spec"]["mpiReplicaSpecs"]
        return job, [specs[kind]["template"]["spec"] for kind in ("Launcher", "Worker")]

    job, specs = pods()
    assert job["spec"]["sshAuthMountPath"] == "/home/mpiuser/.ssh"
    for pod in specs:
        assert pod["securityContext"] == {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True,
                                          "fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}}
        assert pod["containers"][0]["securityContext"] == {"allowPrivilegeEscalation": False,
                                                           "capabilities": {"drop": ["ALL"]}}
    assert answers(project)["k8s"] == {}  # a new project records no k8s answers: the defaults apply

    assert run("k8s", "--project", str(project), "--root").exit_code == 0
    job, specs = pods()
    assert job["spec"]["sshAuthMountPath"] == "/root/.ssh"
    assert all(pod["securityContext"] == {"runAsUser": 0, "runAsGroup": 0} for pod in specs)
    assert "/root/.ssh/id_rsa" in specs[1]["containers"][0]["args"]
    assert answers(project)["k8s"]["non_root"] is False
    assert run("k8s", "--project", str(project), "--check").exit_code == 0

    # The answer sticks until changed; --non-root turns it back.
    assert run("k8s", "--project", str(project), "--workers", "3").exit_code == 0
    assert pods()[0]["spec"]["sshAuthMountPath"] == "/root/.ssh"
    assert run("k8s", "--project", str(project), "--non-root").exit_code == 0
    assert pods()[0]["spec"]["sshAuthMountPath"] == "/home/mpiuser/.ssh"


def test_answers_recorded_by_an_older_hvdgen_keep_working(project):
    """An older hvdgen recorded every answer, non_root: false (its default) included."""
    recorded = answers(project)
    recorded["k8s"] = {"workers": 2, "gpus_per_worker": 1, "image": "", "gpu_image": "", "namespace": "default",
                       "elastic": False, "min_workers": 0, "max_workers": 0, "non_root": False,
                       "mlflow_uri_from": "configmap", "checkpoint_size": "10Gi"}
    (project / SPEC_FILE).write_text(yaml.safe_dump(recorded, sort_keys=False))
    result = run("k8s", "--project", str(project), "--workers", "4")
    assert result.exit_code == 0, result.output
    job = yaml.safe_load((project / "k8s/base/mpijob.yaml").read_text())
    assert job["spec"]["sshAuthMountPath"] == "/root/.ssh" and job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == 4
    assert run("k8s", "--project", str(project), "--check").exit_code == 0


def test_model_split_gpu_overlay_gives_each_rank_a_gpu_per_stage(tmp_path):
    made = run("new", "ms", "--strategy", "model-split", "--stages", "2", "--output", str(tmp_path))
    assert made.exit_code == 0, made.output
    project = tmp_path / "ms"
    patch = yaml.safe_load((project / "k8s/overlays/gpu/mpijob-patch.yaml").read_text())
    worker = patch["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 2  # 2 stages x 1 rank per worker
    assert "slotsPerWorker" not in patch["spec"]  # 1, as in the base
    assert "2 workers x 2 GPUs; each rank puts its 2 stages on 2 GPUs of its own, so 1 rank per worker " \
           "(`slotsPerWorker: 1`): 2 ranks" in (project / "k8s/README.md").read_text()

    assert run("k8s", "--project", str(project), "--gpus-per-worker", "4").exit_code == 0
    patch = yaml.safe_load((project / "k8s/overlays/gpu/mpijob-patch.yaml").read_text())
    launcher = patch["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    assert patch["spec"]["slotsPerWorker"] == 2 and launcher["args"][:2] == ["-np", "4"]
    assert run("k8s", "--project", str(project), "--check").exit_code == 0


def test_new_loads_no_validation_library(tmp_path):
    """`hvdgen new` builds manifests from code and leaves validating them to the tests and to
    `hvdgen k8s --check`: loading the schemas would be most of its run time."""
    import subprocess
    import sys

    code = ("import sys; from hvdgen.cli import main\n"
            "try:\n    main(['new', 'demo', '-o', sys.argv[1]])\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print(sorted(m for m in ('jsonschema', 'kubernetes_validate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "demo/k8s/base/mpijob.yaml").is_file()


def test_cli_start_up_loads_no_validation_library():
    """The k8s command registers with click alone; schemas load only when a manifest is validated."""
    import subprocess
    import sys

    code = ("import sys, hvdgen.cli; "
            "print(sorted(m for m in ('jsonschema', 'kubernetes_validate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_an_elastic_project_gets_an_elastic_job(tmp_path):
    from hvdgen.spec import ProjectSpec

    if "elastic" not in ProjectSpec.__dataclass_fields__:
        pytest.skip("Requires: hvdgen new --elastic")
    result = run("new", "demo", "--elastic", "--output", str(tmp_path))
    assert result.exit_code == 0, result.output
    job = yaml.safe_load((tmp_path / "demo/k8s/base/mpijob.yaml").read_text())
    args = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["args"]
    assert "--host-discovery-script" in args
    assert run("k8s", "--project", str(tmp_path / "demo"), "--no-elastic").exit_code == 0
    job = yaml.safe_load((tmp_path / "demo/k8s/base/mpijob.yaml").read_text())
    assert "--hostfile" in job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["args"]


def test_pipeline_jobs_run_whole_pipelines(tmp_path):
    """-np must be stages x replicas: a 3-stage pipeline gets 3 workers, and 4 are refused."""
    from click.testing import CliRunner

    from hvdgen.cli import main

    runner = CliRunner()
    made = runner.invoke(main, ["new", "pp", "--strategy", "pipeline", "--stages", "3", "--output", str(tmp_path)])
    assert made.exit_code == 0, made.output
    job = yaml.safe_load((tmp_path / "pp" / "k8s" / "base" / "mpijob.yaml").read_text())
    assert job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == 3
    refused = runner.invoke(main, ["k8s", "--project", str(tmp_path / "pp"), "--workers", "4"])
    assert refused.exit_code != 0
    assert "not a multiple of the pipeline's 3 stages: use e.g. --workers 6" in refused.output


def test_check_reads_what_kubectl_get_prints(project):
    """`kubectl get mpijob,pvc -o yaml` prints one `kind: List`; its items are the objects checked."""
    job = yaml.safe_load((project / "k8s/base/mpijob.yaml").read_text())
    claim = yaml.safe_load((project / "k8s/base/checkpoints-pvc.yaml").read_text())
    listing = {"apiVersion": "v1", "kind": "List", "items": [job, claim]}
    assert run("k8s", "--check", "--file", "-", input=yaml.safe_dump(listing)).exit_code == 0
    job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["hostNetwork"] = True
    result = run("k8s", "--check", "--file", "-", input=yaml.safe_dump(listing))
    assert result.exit_code == 1 and "hostNetwork: true shares the node's network namespace" in result.stderr
