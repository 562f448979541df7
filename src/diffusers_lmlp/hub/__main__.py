"""`python -m diffusers_lmlp.hub`: publish a saved pipeline (`push`) or the demo Space (`push-space`)."""

import argparse
import logging
import sys

from .. import commands
from .space import DEFAULT_SPACE_DIR, MODEL_VARIABLE, SPACE_FILE_LIMIT, SPACE_TOTAL_LIMIT, push_space, stage_space
from .upload import IMAGE_LIMIT, TEXT_LIMIT, StagedUpload, check_repo_id, upload_report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=commands.program_name("diffusers-lmlp-hub", "diffusers_lmlp.hub"),
        description="Publish to the Hugging Face Hub in one commit; --dry-run uploads nothing and writes the exact "
        "folder that would be uploaded.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    push = subparsers.add_parser(
        "push",
        help="a saved pipeline folder (or a LoRA adapter folder) -> a model repo",
        description="Upload a saved pipeline or LoRA folder with its model card: weights (safetensors), configs, "
        "tokenizer files and images. Never: checkpoints, logs, pickles, the folder's .py files, links, credentials, "
        f"secrets, or files but weights over {TEXT_LIMIT[0] // 10**6} MB (images: {IMAGE_LIMIT[0] // 10**6} MB).",
    )
    push.add_argument("folder", help="the saved pipeline folder, or a LoRA adapter folder (the trainer's --lora_rank)")
    push.add_argument("repo_id", help="the model repo, owner/name (or name: the token's user)")
    push.add_argument("--license", help="the card's license (default: the card's own, else apache-2.0)")
    push.add_argument("--base-model", help="the Hub model it was fine-tuned from (for a LoRA, the pipeline it loads)")
    push.add_argument("--dataset", action="append", dest="datasets", help="a Hub dataset it was trained on (repeat)")
    push.add_argument("--sample-prompts", nargs="+", help="generate a captioned samples.png from these prompts")
    push.add_argument("--sample-steps", type=int, default=25, help="sampling steps for --sample-prompts")
    push.add_argument("--seed", type=int, default=0, help="seed for --sample-prompts")
    push.add_argument("--revision", help="an existing branch to commit to (default: main)")
    push.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    push.add_argument("--commit-message", help='default: "Upload LMLPPipeline", or "Upload LoRA adapter"')
    push.add_argument(
        "--with-code",
        action="store_true",
        help="also upload the pipeline's and backbone's code, generated from the installed package, so that "
        "DiffusionPipeline.from_pretrained(repo, trust_remote_code=True) loads it without diffusers-lmlp",
    )
    space = subparsers.add_parser(
        "push-space",
        help="the demo -> a Gradio Space serving model repos",
        description="Upload the Gradio demo (spaces/lmlp-demo/) with this install's package source beside it, and set "
        f"its models: and the Space variable {MODEL_VARIABLE} to --model; it serves repos pushed with or without "
        f"--with-code and runs none of their code. The guards of push apply, with {SPACE_FILE_LIMIT[0] // 10**6} MB a "
        f"file and {SPACE_TOTAL_LIMIT[0] // 10**6} MB in all.",
    )
    space.add_argument("space_id", help="the Space repo, owner/name")
    space.add_argument("--model", required=True, nargs="+", help="the model repos it serves, the first opening")
    space.add_argument("--space-dir", default=DEFAULT_SPACE_DIR, help="the demo folder (default: %(default)s)")
    space.add_argument("--commit-message", default="Upload the diffusers-lmlp demo")
    for command in (push, space):
        command.add_argument("--token", help="a Hub token with write access (default: HF_TOKEN or `hf auth login`)")
        command.add_argument("--private", action="store_true", default=None, help="create the repo private")
        command.add_argument("--dry-run", action="store_true", help="upload nothing; write the folder to upload")
        command.add_argument("--output-dir", help="with --dry-run: where to write it (default: a new temp folder)")
    return parser


def report_dry_run(staged: StagedUpload, repo: str) -> None:
    """Print the folder a push would upload, its files, and what it refuses and leaves out (the push logs these)."""
    print(f"Dry run, nothing was uploaded. The folder that would be uploaded to {repo}: {staged.folder.resolve()}")
    print("\n".join([*(f"  {path}" for path in staged.files), upload_report(staged)]).rstrip())


def main(argv: list[str] | None = None) -> None:
    """Run the command on `argv` (default `sys.argv[1:]`); the publishers (diffusers) load after parsing."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(message)s")  # a push logs what it did not upload, as the dry run prints it
    logging.getLogger("diffusers_lmlp.hub").setLevel(logging.INFO)
    if args.output_dir and not args.dry_run:
        parser.error("--output-dir only goes with --dry-run (a real push stages in a temporary folder)")
    from .model import is_lora_folder, push_lora, push_pipeline, stage_lora, stage_pipeline

    try:
        if args.command == "push-space":
            check_repo_id(args.space_id, "Space id", namespace=True)
            if args.dry_run:
                report_dry_run(stage_space(args.model, args.space_dir, args.output_dir), f"the Space {args.space_id}")
                return print(f"A push also sets the Space variable {MODEL_VARIABLE}={','.join(args.model)}.")
            commit = push_space(
                args.space_id, args.model, args.space_dir, args.token, args.private, args.commit_message
            )
        else:
            options = {"license": args.license, "base_model": args.base_model}
            if is_lora_folder(args.folder):
                pipeline_only = {"--with-code": args.with_code, "--dataset": args.datasets,
                                 "--sample-prompts": args.sample_prompts}  # fmt: skip
                if given := [option for option, value in pipeline_only.items() if value]:
                    parser.error(
                        f"{', '.join(given)}: {args.folder} is a LoRA adapter folder, and these apply to pipeline "
                        "folders only (push the base pipeline with them)"
                    )
                stage, push, message = stage_lora, push_lora, "Upload LoRA adapter"
            else:
                options.update(datasets=args.datasets, sample_prompts=args.sample_prompts, with_code=args.with_code,
                               sample_steps=args.sample_steps, seed=args.seed)  # fmt: skip
                stage, push, message = stage_pipeline, push_pipeline, "Upload LMLPPipeline"
            if args.dry_run:
                staged = stage(args.folder, args.repo_id, args.output_dir, **options)
                report_dry_run(staged, f"the model repo {args.repo_id}")
                if "/" not in args.repo_id:
                    print(f"A push names the repo <token user>/{args.repo_id}, in the card too.")
                return
            commit = push(
                args.folder, args.repo_id, token=args.token, private=args.private,
                commit_message=args.commit_message or message, revision=args.revision, create_pr=args.create_pr,
                **options,
            )  # fmt: skip
    except (ValueError, OSError) as err:  # bad input, and huggingface_hub's HTTP and offline errors
        sys.exit(f"error: {err}")
    print(f"Uploaded: {commit.pr_url or commit.commit_url}")


if __name__ == "__main__":
    main()
