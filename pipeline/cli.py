"""The command line: `python -m pipeline <stage>` or `eagle3-pipeline run <stage>`."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import click

from pipeline.errors import PipelineError
from pipeline.params import ParamsError, load_params
from pipeline.stages import SECTION, STAGES


def _run_stage(stage: str, params_file: Path) -> None:
    try:
        section = getattr(load_params(params_file), SECTION[stage])
        importlib.import_module(f"pipeline.stages.{stage}").run(section)
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
