"""The command line: `python -m pipeline <stage>` or `eagle3-pipeline run <stage>`."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path

import click

from pipeline import console
from pipeline.errors import PipelineError
from pipeline.params import ParamsError, load_params
from pipeline.stages import CPU_PINNED, SECTION, STAGES
from pipeline.training import cpu_determinism
from pipeline.workflow.launcher import IN_CONTAINER, launch, tidy_other_stages


def _run_stage(stage: str, params_file: Path) -> None:
    try:
        params = load_params(params_file)
        # the stage runs in this process (not by exec'ing docker, whose container does this itself):
        # the libraries' and the engine's output go to logs/<stage>.log from the first import on
        here = params.runtime.mode != "docker" or os.environ.get(IN_CONTAINER) == "1" or SECTION[stage] is None
        with console.stage_output(stage) if here else contextlib.nullcontext():
            if stage in CPU_PINNED:  # before the stage's module imports torch: ATen and MKL read them once
                for name, value in cpu_determinism.pin_environment().items():
                    console.say(f"[{stage}] {name}={value} overridden by {cpu_determinism.PINNED_ENV[name]} "
                                "(pipeline/training/cpu_determinism.py)", err=True)
            module = importlib.import_module(f"pipeline.stages.{stage}")
            if SECTION[stage] is None:  # the check reads everything and loads nothing: always here, never in a container
                module.run(params)
                # it runs first after any edit of params.yaml or the data: what killed runs left beside a
                # result DVC restored goes now, not only at the next run of another stage
                tidy_other_stages()
                return
            section = getattr(params, SECTION[stage])
            # here, or in the container per runtime.mode (pipeline/workflow/launcher.py)
            launch(stage, params, params_file, lambda: module.run(section))
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

    reads = SECTION[stage] or "all of it"
    return click.command(stage, help=f"Run the {stage} stage (reads params.yaml: {reads}).")(cmd)


for _stage in STAGES:
    main.add_command(_stage_command(_stage))


@main.command("summary")
@click.option("--since", type=float, help="Only the stages whose metrics were written at or after this Unix time "
              "(the Makefile passes the time `dvc repro` started).")
def summary_cmd(since: float | None) -> None:
    """What the stages that ran found: extraction, verification, the draft's tau, reports, how to share; first,
    what killed runs left beside results DVC restored from its cache (`make` runs this after `dvc repro`)."""
    from pipeline.workflow import summary

    if tidied := tidy_other_stages():
        console.say(f"tidied what a killed run left beside restored results: {', '.join(map(str, tidied))}")
    summary.main(since)


@main.command("check-params")
@click.pass_obj
def check_params(params_file: Path) -> None:
    """Validate params.yaml, the data file and the target's limits (the check stage's checks) and exit."""
    from pipeline.workflow import input_checks

    try:
        found = input_checks.problems(load_params(params_file))
    except ParamsError as e:
        click.secho(str(e), fg="red", err=True)
        sys.exit(1)
    if found:
        click.secho(f"{params_file}: " + "\n  ".join(["refused:", *found]), fg="red", err=True)
        sys.exit(1)
    click.echo(f"{params_file}: ok")


@main.command("export")
@click.option("--format", "fmt", required=True, type=click.Choice(["speculators-0.3", "speculators-0.9"]))
@click.option("--out", required=True, type=click.Path(path_type=Path), help="a new (or empty) directory")
def export_cmd(fmt: str, out: Path) -> None:
    """Export artifacts/hidden_states to a speculators training-data layout (pipeline/hidden_states/export.py)."""
    from pipeline.hidden_states.export import export

    try:
        export(fmt, out)
    except PipelineError as e:
        click.secho(f"[export] error: {e}", fg="red", err=True)
        sys.exit(1)


def _layer_list(value: str | None) -> list[int] | None:
    return None if value is None else [int(x) for x in value.replace("[", "").replace("]", "").split(",") if x.strip()]


@main.command("plan")
@click.option("--tokens", type=float, help="Project this many tokens instead of the prepared dataset's (e.g. 1e9).")
@click.option("--samples", type=int, help="With --tokens: samples (default tokens / data.seq_len).")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A model's config.json to project instead of artifacts/model (e.g. examples/kimi-k2.5-config.json).")
@click.option("--hidden-size", type=int, help="Override the model's hidden size.")
@click.option("--num-layers", type=int, help="Override the model's decoder layer count.")
@click.option("--layer-ids", help="Override extract.layer_ids, e.g. 2,30,58,61.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16", "float8_e4m3"]), help="Override extract.dtype.")
@click.option("--weights-gib", type=float, help="Checkpoint size in GiB (default: the target's weight files).")
@click.option("--gpu-gib", type=float, help="Memory per GPU in GiB, for a machine that is not this one.")
@click.option("--tensor-parallel-size", type=int, help="Override extract.tensor_parallel_size (GPUs the weights are split over).")
@click.option("--tok-per-s", type=float, help="Assumed extraction throughput (default: measured here).")
@click.option("--calibrate/--no-calibrate", default=None,
              help="Force / forbid the short calibration extraction (default: only when no extraction ran here).")
@click.option("--json", "json_out", is_flag=True, help="Also write the projection to reports/plan.json.")
@click.pass_obj
def plan_cmd(params_file: Path, tokens, samples, config_path, hidden_size, num_layers, layer_ids, dtype, weights_gib,
             gpu_gib, tensor_parallel_size, tok_per_s, calibrate, json_out) -> None:
    """Project the extraction's bytes, free space, wall time and engine memory (pipeline/planning/plan.py)."""
    import json

    from pipeline.atomic import atomic_write_text
    from pipeline.planning import plan

    try:
        params = load_params(params_file)
        config = None
        if config_path:
            raw = json.loads(config_path.read_text())
            config = raw.get("text_config", raw)
        ext = params.extract
        n = (tensor_parallel_size or ext.tensor_parallel_size) * ext.pipeline_parallel_size
        gpus = None if gpu_gib is None else [int(gpu_gib * 2**30)] * n
        p = plan.build_plan(params, tokens=tokens, samples=samples, config=config, hidden_size=hidden_size,
                            num_layers=num_layers, layer_ids=_layer_list(layer_ids), dtype=dtype, weights_gib=weights_gib,
                            tok_per_s=tok_per_s, do_calibrate=calibrate, gpus=gpus,
                            tensor_parallel_size=tensor_parallel_size)
        plan.render(p)
        if json_out:
            plan.PLAN_JSON.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(plan.PLAN_JSON, json.dumps(p.to_json(), indent=1, default=str) + "\n")
    except PipelineError as e:
        click.secho(f"[plan] error: {e}", fg="red", err=True)
        sys.exit(1)


@main.command("upgrade-layout")
@click.option("--dry-run", is_flag=True, help="Say which stages would be re-recorded; commit nothing.")
def upgrade_layout_cmd(dry_run: bool) -> None:
    """After the move to packages or to run-cacheable outputs: re-record the stages whose only changes are their code's
    new paths and reports now in DVC's cache, and the stages up to date into the run-cache (dvc commit -f), so a
    finished project re-runs nothing the upgrade did not change (pipeline/workflow/upgrade_layout.py)."""
    from pipeline.workflow.upgrade_layout import upgrade

    try:
        upgrade(Path("."), dry_run=dry_run, echo=click.echo)
    except PipelineError as e:
        click.secho(f"[upgrade-layout] error: {e}", fg="red", err=True)
        sys.exit(1)


@main.command("sweep")
@click.option("--layer-sets", help="Grid of extract.layer_ids, ';'-separated, e.g. '2,4,5,8;3,5,6,8' (default: the "
              "default layers, shifted by one, and a shallow set).")
@click.option("--train-epochs", type=int, envvar="SWEEP_TRAIN_EPOCHS",
              help="train.epochs for every point (shorter runs on CPU); env SWEEP_TRAIN_EPOCHS.")
@click.pass_obj
def sweep_cmd(params_file: Path, layer_sets: str | None, train_epochs: int | None) -> None:
    """Run a grid of layer-id sets as DVC experiments, each through verify, train and eval; print one table."""
    from pipeline.workflow import sweep

    if params_file != Path("params.yaml"):
        click.secho("[sweep] error: DVC experiments set params in params.yaml; run without --params", fg="red", err=True)
        sys.exit(1)
    try:
        sweep.main(layer_sets, train_epochs)
    except PipelineError as e:
        click.secho(f"[sweep] error: {e}", fg="red", err=True)
        sys.exit(1)
