"""`python -m diffusers_lmlp.hub`: publish a saved pipeline (`push`) or the demo Space (`push-space`)."""

import argparse
import logging
import sys

from .. import commands
from .space import DEFAULT_SPACE_DIR, MODEL_VARIABLE, SPACE_FILE_LIMIT, SPACE_TOTAL_LIMIT, push_space, stage_space
from .upload import IMAGE_LIMIT, TEXT_LIMIT, StagedUpload, check_repo_id, upload_report


CONSOLE_SCRIPT = "diffusers-lmlp-hub"


def program_name(argv0: str | None = None) -> str:
    """How the user ran this command (`argv0`, default `sys.argv[0]`), for its usage lines."""
    return commands.program_name(CONSOLE_SCRIPT, "diffusers_lmlp.hub", argv0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=program_name(),
        description="Publish to the Hugging Face Hub. Each push is one commit; --dry-run uploads nothing and writes "
        "the exact folder that would be uploaded.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    push = commands.add_parser(
        "push",
        help="a saved pipeline folder (or a LoRA adapter folder) -> a model repo",
        description="Upload a folder written by LMLPPipeline.save_pretrained (or the training script) with its "
        "model card: safetensors weights, configs, tokenizer files and images only (--with-code adds code generated "
        "from the installed package). Never uploaded: checkpoint-*, logs, pickles, the folder's own .py files, links "
        "(none is followed), files named like credentials (token.txt, secrets.json, .env, *.pem, ...), files that "
        "hold a token or a private key (hf_..., ghp_..., sk-..., ...), and files other than the weights over "
        f"{TEXT_LIMIT[0] // 10**6} MB (images: {IMAGE_LIMIT[0] // 10**6} MB); each is listed with its reason, never "
        "the secret. An existing README.md keeps its text; its metadata and usage block are updated.",
    )
    push.add_argument(
        "folder",
        help="the saved pipeline folder (with model_index.json), or a LoRA adapter folder (with "
        "pytorch_lora_weights.safetensors, as the trainer's --lora_rank writes it)",
    )
    push.add_argument("repo_id", help="the model repo, owner/name (or name: the token's user)")
    push.add_argument("--license", help="the card's license (default: the card's own, else apache-2.0)")
    push.add_argument(
        "--base-model",
        help="the Hub model it was fine-tuned from (card metadata; for a LoRA, the pipeline its snippet loads)",
    )
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
        help="also upload the code of the pipeline and its backbone, generated from the installed diffusers-lmlp, so "
        "that DiffusionPipeline.from_pretrained(repo, trust_remote_code=True) loads the repo without the package; "
        "that runs the code on the machine that loads it, and the card says so",
    )

    space = commands.add_parser(
        "push-space",
        help="the demo -> a Gradio Space serving model repos",
        description="Upload the Gradio demo, spaces/lmlp-demo/ (app.py, README.md, requirements.txt; it ships in "
        "the package too) and this install's package source beside it (diffusers-lmlp is not on PyPI), with its "
        f"README front matter's models: set to --model, and set the Space variable {MODEL_VARIABLE}=--model. The app "
        "loads each model with LMLPPipeline.from_pretrained, so a repo pushed with or without --with-code serves, and "
        "none of its code runs. As with push, links, files named like credentials and files that hold a token are "
        f"never uploaded; nor are files over {SPACE_FILE_LIMIT[0] // 10**6} MB, and a folder over "
        f"{SPACE_TOTAL_LIMIT[0] // 10**6} MB in all is refused.",
    )
    space.add_argument("space_id", help="the Space repo, owner/name")
    space.add_argument(
        "--model", required=True, nargs="+",
        help="the model repos the Space serves, the first opening",
    )  # fmt: skip
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
    print("\n".join(f"  {path}" for path in staged.files))
    if report := upload_report(staged):
        print(report)


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
                print(f"A push also sets the Space variable {MODEL_VARIABLE}={','.join(args.model)}.")
                return
            commit = push_space(
                args.space_id, args.model, args.space_dir, token=args.token, private=args.private,
                commit_message=args.commit_message,
            )  # fmt: skip
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
                report_dry_run(
                    stage(args.folder, args.repo_id, args.output_dir, **options), f"the model repo {args.repo_id}"
                )
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
