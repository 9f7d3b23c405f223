"""The command line: `python -m pipeline <stage>` or `eagle3-pipeline run <stage>`."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import click

from pipeline.errors import PipelineError
from pipeline.launcher import launch
from pipeline.params import ParamsError, load_params
from pipeline.stages import SECTION, STAGES


def _run_stage(stage: str, params_file: Path) -> None:
    try:
        params = load_params(params_file)
        section = getattr(params, SECTION[stage])
        # here, or in the container per runtime.mode (pipeline/launcher.py)
        launch(stage, params, params_file, lambda: importlib.import_module(f"pipeline.stages.{stage}").run(section))
    except PipelineError as e:
        click.secho(f"[{stage}] error: {e}", fg="red", err=True)
        sys.exit(1)


@click.group()
@click.option("--params", "params_file", default="params.yaml", type=click.Path(path_type=Path), show_default=True)
@click.pass_context
def main(ctx: click.Context, params_file: Path) -> None:
    """eagle3-pipeline: build a verified EAGLE-3 draft for a target LLM."""
    ctx.obj = params_file


@main.command("run")
@click.argument("stage", type=click.Choice(STAGES))
@click.pass_obj
def run_cmd(params_file: Path, stage: str) -> None:
    """Run one stage (what every dvc.yaml cmd calls)."""
    _run_stage(stage, params_file)


def _stage_command(stage: str) -> click.Command:
    @click.pass_obj
    def cmd(params_file: Path) -> None:
        _run_stage(stage, params_file)

    return click.command(stage, help=f"Run the {stage} stage (reads params.yaml: {SECTION[stage]}).")(cmd)


for _stage in STAGES:
    main.add_command(_stage_command(_stage))


@main.command("check-params")
@click.pass_obj
def check_params(params_file: Path) -> None:
    """Validate params.yaml and exit."""
    try:
        load_params(params_file)
    except ParamsError as e:
        click.secho(str(e), fg="red", err=True)
        sys.exit(1)
    click.echo(f"{params_file}: ok")


@main.command("export")
@click.option("--format", "fmt", required=True, type=click.Choice(["speculators-0.3", "speculators-0.9"]))
@click.option("--out", required=True, type=click.Path(path_type=Path), help="a new (or empty) directory")
def export_cmd(fmt: str, out: Path) -> None:
    """Export artifacts/hidden_states to a speculators training-data layout (pipeline/export.py)."""
    from pipeline.export import export

    try:
        export(fmt, out)
    except PipelineError as e:
        click.secho(f"[export] error: {e}", fg="red", err=True)
        sys.exit(1)
