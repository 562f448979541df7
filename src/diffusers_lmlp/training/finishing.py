"""The end of a run: the processes check that the ranks agree, the main process saves the pipeline (or the LoRA
adapter) with its card, summary, samples and final scores and pushes it with `--push_to_hub`, and all leave together.

`public_args` is what of the arguments leaves the process: never the secrets.
"""

import argparse
import atexit
import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from diffusers_lmlp.hub import write_model_card
from diffusers_lmlp.hub.lora_card import recorded_base_model, write_lora_card
from diffusers_lmlp.image_grid import make_image_grid
from diffusers_lmlp.training.compilation import plain_backbone
from diffusers_lmlp.training.lora import save_adapter
from diffusers_lmlp.training.report import format_run_summary
from diffusers_lmlp.training.validation import (
    build_pipeline,
    default_validation_prompts,
    final_evaluation,
    generate,
    score_summary,
)
from diffusers_lmlp.worlds import WORLDS


logger = get_logger(__name__)

# A finished multi-process run's teardown that takes longer has hung: its stacks are dumped and it exits (1).
TEARDOWN_TIMEOUT_SECONDS = 120
# Arguments that never leave this process: kept out of trackers, logs, the model card and training_summary.json.
SECRET_ARGUMENTS = frozenset({"hub_token"})


def public_args(args: argparse.Namespace) -> dict:
    """The arguments without the secrets (`SECRET_ARGUMENTS`): all that trackers, the card and the summary see."""
    return {name: value for name, value in vars(args).items() if name not in SECRET_ARGUMENTS}


def ranks_in_sync(accelerator: Accelerator, model) -> bool:
    """Whether every process ended with the same weights (a wrong multi-process launch trains them separately)."""
    flat = torch.cat([p.detach().float().flatten() for p in plain_backbone(accelerator, model).parameters()])
    digest = torch.tensor([flat.sum().item(), (flat * flat).sum().item()], dtype=torch.float64, device=flat.device)
    gathered = accelerator.gather(digest[None]).view(-1, 2)
    return bool((gathered == gathered[0]).all())


def end_run(
    accelerator: Accelerator,
    model,
    ema,
    tokenizer,
    text_encoder,
    vae,
    args,
    output_dir: Path,
    train_seconds: float,
    exit_when_done: bool = False,
) -> None:
    """After the last step: check that the ranks agree, `finish` on the main process, then leave together.

    `exit_when_done` ends the process here (`leave_finished_process`), before the caller's frames free objects whose
    C++ destructors can hang after a multi-process run (pytorch/pytorch#190489).
    """
    accelerator.wait_for_everyone()
    in_sync = ranks_in_sync(accelerator, model)
    if accelerator.is_main_process:
        finish(accelerator, model, ema, tokenizer, text_encoder, vae, args, output_dir, train_seconds, in_sync)
    # A rank that tears down its process group while the main process still saves leaves it waiting at exit.
    accelerator.wait_for_everyone()
    if accelerator.num_processes > 1:  # everything is saved: a teardown that hangs must not hold the job forever
        faulthandler.dump_traceback_later(TEARDOWN_TIMEOUT_SECONDS, exit=True)
    accelerator.end_training()
    if exit_when_done:
        leave_finished_process()


def finish(accelerator, model, ema, tokenizer, text_encoder, vae, args, output_dir: Path, seconds, in_sync) -> None:
    """Save the pipeline (EMA weights unless EMA is off) with a model card; score it on its world."""
    unwrapped = plain_backbone(accelerator, model)
    if ema is not None:
        ema.copy_to(unwrapped.parameters())
    unwrapped.eval()
    pipe = build_pipeline(unwrapped, tokenizer, text_encoder, vae)
    if args.lora_rank:
        save_adapter(unwrapped, output_dir)
    else:
        pipe.save_pretrained(output_dir)

    summary = {
        **({"base_model": recorded_base_model(args.pretrained_model_name_or_path)} if args.lora_rank else {}),
        "num_processes": accelerator.num_processes,
        "ranks_in_sync": in_sync,
        "steps": args.max_train_steps,
        "train_seconds": round(seconds, 1),
    }
    prompts = default_validation_prompts(args)
    grid_path = None
    if prompts:
        summary["sample_prompts"] = prompts  # the card's usage snippet samples the first
        images = generate(pipe, prompts, args, seed=args.seed)
        grid_path = output_dir / "samples.png"
        make_image_grid(images, captions=prompts).save(grid_path)
    if args.world:
        reports = final_evaluation(pipe, args)
        summary["world"] = args.world
        summary.update(score_summary(reports, args.world))
        if args.lora_rank:  # the base model, by the same evaluation: what the adapter changed
            unwrapped.disable_adapters()
            before = final_evaluation(pipe, args)
            unwrapped.enable_adapters()
            summary.update(score_summary(before, args.world, suffix="_before"))
        summary["images_per_caption"] = WORLDS[args.world].final_seeds
        summary["evaluation_sampler"] = reports["train"]["sampler"]
        # The whole reports go to the logs folder; the scores are in the summary.
        reports_path = output_dir / args.logging_dir / "evaluation.json"
        reports_path.parent.mkdir(parents=True, exist_ok=True)
        whole = {"adapted": reports, "base": before} if args.lora_rank else reports
        reports_path.write_text(json.dumps(whole, indent=1), encoding="utf-8")
    with open(output_dir / "training_summary.json", "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    if args.lora_rank:
        write_lora_card(output_dir, unwrapped, args=public_args(args), summary=summary, sample_grid=grid_path)
        logger.info(f"saved the LoRA adapter to {output_dir}")
    else:
        write_model_card(output_dir, pipe, args=public_args(args), summary=summary, sample_grid=grid_path)
        logger.info(f"saved the pipeline to {output_dir}")

    hub_url = None
    if args.push_to_hub:
        # The same upload as `python -m diffusers_lmlp.hub push`: never checkpoints, logs or pickles; one commit.
        from diffusers_lmlp.hub import push_lora, push_pipeline

        push = push_lora if args.lora_rank else push_pipeline
        commit = push(
            output_dir, args.hub_model_id or output_dir.name, token=args.hub_token, commit_message="End of training"
        )
        logger.info(f"pushed to the Hub: {commit.commit_url}")
        hub_url = commit.commit_url
    logging_dir, validation_dir = output_dir / args.logging_dir, output_dir / "validation"
    text = format_run_summary(
        summary,
        output_dir,
        sample_grid=grid_path,
        validation_dir=validation_dir if validation_dir.is_dir() else None,
        logging_dir=logging_dir if logging_dir.is_dir() else None,
        hub_url=hub_url,
    )
    print(f"\n{text}", flush=True)


def leave_finished_process() -> None:
    """End a process of a finished multi-process run without the interpreter's finalization.

    The `atexit` handlers still run; what is skipped is the teardown of objects, modules and C++ statics, where torch's
    autograd and gloo threads can race the GIL's destruction and hang the process (pytorch/pytorch#190489).
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
