"""Typed run configuration: one dataclass per concern, each field documented once in its `help`
metadata (shown by `--help`). open_sft.config.parse parses flags and run YAMLs into it and open_sft.config.checks
validates it. Flag names follow allenai/open-instruct `finetune.py` so existing command lines keep
working (its flags that are not ours: open_sft.config.open_instruct).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from open_sft.config.fields import help_field as _help
from open_sft.config.optimizer_args import OptimizerArguments
from open_sft.redaction import redact_secrets


def _aliased(alias: str, text: str, **kwargs: Any) -> Any:
    """A field with a second flag name (open-instruct's), parsed into the same field."""
    return field(metadata={"help": text, "aliases": [alias]}, **kwargs)


@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = _help(
        "Local model directory or Hub id of the model to fine-tune.", default=None
    )
    tokenizer_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Tokenizer directory or Hub id; defaults to --model_name_or_path.",
                                "aliases": ["--tokenizer_name"]})
    tokenizer_revision: Optional[str] = _help("Hub revision of the tokenizer; defaults to --model_revision.",
                                              default=None)
    config_name: Optional[str] = _help(
        "Model config directory or Hub id, if not the same as --model_name_or_path.", default=None
    )
    model_revision: Optional[str] = _help("Hub revision (branch, tag or commit) of the model.", default=None)
    trust_remote_code: bool = _help("Allow custom modelling code from the model repository.", default=False)
    additional_model_arguments: Optional[str] = _help(
        "Model config overrides: a JSON object (or YAML mapping) of settings the model's config has (another key "
        "is refused), e.g. '{\"max_position_embeddings\": 8192}'.", default=None)
    torch_dtype: Literal["auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32"] = _help(
        "Compute dtype: auto (bf16 where it is fast; fp16 on GPUs without bf16), bfloat16, float16 or float32. "
        "Parameters and optimizer states stay in fp32 (autocast, or DeepSpeed's bf16/fp16 mode with fp32 "
        "master weights); float16 adds dynamic loss scaling.",
        default="auto",
    )
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = _help(
        "Attention kernel: auto (flash_attention_2 on CUDA when installed, else sdpa), sdpa, eager, "
        "flash_attention_2.",
        default="auto",
    )
    gradient_checkpointing: bool = _help("Recompute activations in the backward pass to save memory.", default=False)
    use_liger_kernel: bool = _help("Use Liger kernels (needs CUDA and Triton).", default=False)
    torch_compile: bool = _help(
        "Compile each decoder layer with torch.compile (fuses the norms, rotary, SiLU and residual adds around "
        "the matmuls; attention stays eager). The first steps include the compilation.", default=False)
    fp8: bool = _help(
        "Train the decoder's large linear layers with FP8 matmuls (torchao's float8 training; the LM head and "
        "the rest stay in bf16, the weights and optimizer as without it). Needs an NVIDIA GPU of compute "
        "capability 8.9+ (Ada, Hopper, Blackwell), --torch_dtype bfloat16, and torchao (pip install "
        "'open_sft[fp8]'); not with LoRA/QLoRA, ZeRO-3, TP, PP or SP.", default=False)
    fp8_recipe: Literal["tensorwise", "rowwise"] = _help(
        "--fp8's scaling: tensorwise (one scale per tensor; the fastest) or rowwise (one per row; closer to "
        "bf16's loss).", default="tensorwise")
    fp8_layers: Literal["auto", "all"] = _help(
        "--fp8's layers: auto (those torchao measured to gain on an H100 for the recipe: large enough that the "
        "casts cost less than the faster matmul saves) or all (every decoder linear layer with dimensions "
        "divisible by 16).", default="auto")
    neftune_noise_alpha: Optional[float] = _help(
        "NEFTune: add uniform noise of scale alpha/sqrt(seq_len*hidden) to the input embeddings during "
        "training (never in eval or generation). Typical values 5-15.", default=None
    )
    add_tokens: Optional[str] = _help(
        "A text file of new tokens, one per line, added to the tokenizer; embeddings grow to a multiple of "
        "64 rows and new rows start at the mean embedding.", default=None
    )
    add_special_tokens: Optional[str] = _help(
        "Like --add_tokens, but the tokens are added as special tokens (never split, skipped when decoding "
        "with skip_special_tokens).", default=None
    )


@dataclass
class LoraArguments:
    use_lora: bool = _help("Train LoRA adapters (peft) instead of the full model; saves the adapter.", default=False)
    use_qlora: bool = _help(
        "QLoRA: LoRA on a base model quantized to 4-bit NF4 with double quantization (bitsandbytes), "
        "bf16 compute. Single process or DDP; not with DeepSpeed.", default=False
    )
    lora_rank: int = _help("LoRA rank r.", default=64)
    lora_alpha: float = _help("LoRA alpha; the adapter update is scaled by alpha / rank.", default=16)
    lora_dropout: float = _help("Dropout on the LoRA input during training.", default=0.1)
    lora_target_modules: list[str] = _help(
        "Module names to adapt (e.g. q_proj v_proj), or all-linear: every linear layer but the LM head, an MoE's "
        "fused expert and plain router weights included (peft target_parameters, no dropout); name those by "
        "parameter (gate_up_proj, experts.down_proj) or module (experts, router).",
        default_factory=lambda: ["all-linear"],
    )
    merge_lora_on_save: bool = _help(
        "Also write the merged full model (base + adapter; QLoRA bases dequantized to bf16) next to the adapter.",
        default=False,
    )


@dataclass
class DataArguments:
    dataset_mixer_list: list[str] = _help(
        "Pairs NAME AMOUNT: NAME a local .jsonl/.json/.parquet/.txt file (.txt: plain text, one document per "
        "blank-line-separated block) or a dataset id; AMOUNT with a '.' "
        "is a fraction of that source (may exceed 1.0 to upsample), without a '.' a row count.",
        default_factory=list,
    )
    dataset_mixer_list_splits: list[str] = _help(
        "Split(s) to read from dataset ids: one for all sources or one per source.",
        default_factory=lambda: ["train"],
    )
    dataset_config_name: Optional[str] = _help(
        "The configuration of Hub datasets (and of local directories laid out as a Hub dataset repository), as "
        "datasets.load_dataset(name=...) takes it.", default=None)
    dataset_mixer_unit: Literal["rows", "tokens", "share"] = _help(
        "What AMOUNTs count: rows; tokens (a fraction is then a share of the source's tokens, a count a number of "
        "tokens); or share: the AMOUNTs are the mixture's shares of examples (positive; normalised to sum 1, said "
        "in the log when they do not), and the mixture is the largest that holds them without repeating a row of "
        "any source: N = min over sources of rows / share, each source giving round(share × N) distinct rows "
        "(rows: those it has, less those --eval_split_ratio holds out).", default="rows"
    )
    dataset_format: Literal["auto", "messages", "alpaca", "sharegpt", "prompt_completion", "text"] = _help(
        "Row format of every source: auto (detected per source from its columns), messages, alpaca, "
        "sharegpt, prompt_completion (TRL's prompt/completion columns), text (raw documents for continual "
        "pretraining, spliced into --max_seq_length blocks).",
        default="auto",
    )
    chat_template_name: Optional[str] = _aliased("--chat_template",
        "Built-in chat template: every name of open-instruct's (tulu, olmo, zephyr, simple_chat, "
        "olmo_thinker, r1_simple_chat, ..., rendering what open-instruct's does), chatml, llama3. "
        "Default: the tokenizer's own.",
        default=None,
    )
    chat_template_path: Optional[str] = _help("A Jinja chat template file (overrides --chat_template_name).",
                                              default=None)
    chat_template_kwargs: Optional[str] = _help(
        "A JSON object of variables passed to every render of the chat template, as apply_chat_template passes "
        "its keyword arguments, e.g. '{\"enable_thinking\": false}' (a mapping in a YAML config).", default=None)
    dataset_mixer_list_chat_template_kwargs: list[str] = _help(
        "Per source, a JSON object of chat template variables over --chat_template_kwargs (one for all sources or one "
        "per source; '{}' for none): a mixture of thinking and non-thinking data for a hybrid model. In a YAML "
        "config, a dataset_mixer_list entry may be a mapping {name, amount, chat_template_kwargs}.",
        default_factory=list)
    reasoning_loss: Literal["train", "mask"] = _help(
        "An assistant turn's reasoning trace (reasoning_content, reasoning or thinking, or <think>...</think> at the "
        "start of its content) as the template writes it: "
        "train it, or mask it (it stays in the context; the answer, tool calls and the tags around it train).",
        default="train")
    reasoning_history: Literal["template", "keep"] = _help(
        "The context of an assistant turn under a template that rewrites earlier turns (Qwen3's and GLM's drop the "
        "reasoning of turns before the last user message): 'template', what the template renders at that point "
        "(a conversation may make several examples), or 'keep', earlier turns as they were generated, their "
        "reasoning kept (one example a conversation, fewer tokens).", default="template")
    add_bos: bool = _help(
        "Begin every chat example with the tokenizer's bos token (prepended to the chat template, as "
        "open-instruct does, unless the template's rendering already opens with it; a tokenizer without one, "
        "such as GPT-NeoX/OLMo's, uses its eos token; a bare tokenizer.json, naming neither, is refused), and "
        "every text document (which has it anyway where the tokenizer's encoding begins a text with it; where bos "
        "is eos, it is the one eos between documents).",
        default=False)
    sft_messages_key: str = _help("The column holding the conversation in messages-format rows.",
                                  default="messages")
    dataset_text_field: str = _help(
        "The column holding the document in text-format rows (TRL's dataset_text_field); a source with that column "
        "is text, and a row without it is read from 'text' (a .txt file's documents).", default="text")
    on_bad_row: Literal["error", "drop"] = _help(
        "A row that fails validation: 'error' stops with its file, line and problem; 'drop' skips it "
        "and counts the reason in the data report.", default="error"
    )
    eval_dataset_mixer_list: list[str] = _help(
        "Evaluation sources, NAME AMOUNT pairs like --dataset_mixer_list (same formats and template; AMOUNTs count "
        "rows, a fraction or a row count, whatever --dataset_mixer_unit says).",
        default_factory=list,
    )
    eval_dataset_mixer_list_splits: list[str] = _help(
        "Split(s) to read from the evaluation dataset ids: one for all evaluation sources or one per source.",
        default_factory=lambda: ["train"],
    )
    eval_split_ratio: float = _help(
        "Hold out this fraction of each source's rows (seeded, before upsampling) for evaluation instead. Each "
        "held-out row is evaluated once, so the evaluation mixture's shares follow the sources' sizes, not the "
        "amounts: the log gives both mixtures' shares.",
        default=0.0
    )
    preprocessing_num_workers: Optional[int] = _help(
        "Processes that render, tokenize and check rows while building the tokenization cache: 1 = in "
        "process (the tokenizer encodes on its own threads while Python renders and labels), N = N worker "
        "processes; unset = one per usable core.",
        default=None,
    )
    max_seq_length: int = _help("Longest tokenized example, in tokens.", default=2048)
    truncation: Literal["truncate", "drop"] = _help(
        "Examples longer than --max_seq_length: 'truncate' cuts them, 'drop' removes them.", default="truncate"
    )
    train_on: Literal["all_assistant", "last_assistant", "all"] = _help(
        "Which tokens get a loss: all_assistant (every assistant turn), last_assistant, all.",
        default="all_assistant",
    )
    dataset_local_cache_dir: str = _help(
        "Directory of the tokenization cache (OPEN_SFT_CACHE overrides it).", default="local_dataset_cache"
    )
    dataset_skip_cache: bool = _help("Tokenize without reading or writing the cache.", default=False)
    cache_dataset_only: bool = _help(
        ("Build the tokenization cache (and the evaluation set's), print the training entry's path on the last line, "
         "and exit without training."), default=False
    )

    def evaluation_sources(self) -> "DataArguments":
        """These settings with --eval_dataset_mixer_list as the sources (its splits; --chat_template_kwargs, not
        per-source ones; AMOUNTs of rows: the training mixture's unit, tokens or shares, would cut the eval set)."""
        return dataclasses.replace(self, dataset_mixer_list=self.eval_dataset_mixer_list,
                                   dataset_mixer_list_splits=self.eval_dataset_mixer_list_splits,
                                   dataset_mixer_list_chat_template_kwargs=[], dataset_mixer_unit="rows")


@dataclass
class TrainingArguments(OptimizerArguments):
    """The run's training flags; the optimizer's and the schedule's are OptimizerArguments'."""

    output_dir: str = _help("Where the model, metrics.jsonl and run.json are written.", default="output/")
    exp_name: Optional[str] = _help(
        "Name of the run: the W&B run name and, with --push_to_hub, the default --hub_revision. The output "
        "directory stays --output_dir (open-instruct appends the name to it; open_sft does not).", default=None)
    per_device_train_batch_size: int = _help("Examples per micro-batch on each process.", default=8)
    per_device_eval_batch_size: Optional[int] = _help(
        "Examples per evaluation batch on each process (no gradients are kept, so it can be larger than the "
        "training micro-batch); default --per_device_train_batch_size.", default=None)
    gradient_accumulation_steps: int = _help("Micro-batches per optimizer step on each process.", default=1)
    num_train_epochs: int = _help("Passes over the training data (ignored when --max_train_steps is set).", default=2)
    max_train_steps: Optional[int] = _help("Total optimizer steps; overrides --num_train_epochs.", default=None)
    max_nonfinite_steps: int = _help(
        "Abort after this many optimizer steps in a row with a non-finite loss or gradient (each is skipped).",
        default=3)
    load_balancing_loss: Optional[bool] = _help(
        "MoE models (Mixtral, Qwen-MoE, OLMoE, GraniteMoE, gpt-oss): add the router's load-balancing loss the way "
        "the model defines it (its router_aux_loss_coef × aux loss of each forward pass), token-weighted like the "
        "language-model loss; logged as aux_loss. Default: on where the model's config asks for it "
        "(output_router_logits: true, as transformers' forward and HF's Trainer do), else off; "
        "--no_load_balancing_loss turns it off.", default=None)
    packing: bool = _help(
        "Pack examples into micro-batches of at most --max_tokens_per_batch tokens (best-fit-decreasing), "
        "positions restarting per example and no attention across examples; removes padding.", default=False)
    max_tokens_per_batch: Optional[int] = _help(
        "Token budget of a packed micro-batch; default per_device_train_batch_size × max_seq_length.", default=None
    )
    balance_micro_batches: Optional[bool] = _help(
        "Lay each global batch out so every rank's micro-batches carry about the same number of tokens (the "
        "fastest rank no longer waits for the slowest at each all-reduce); the examples of each step stay the "
        "same. Default: on, except under --loss_normalization mean, whose mean of micro-batch means it would "
        "change.", default=None)
    clip_grad_norm: float = _help("Clip the global gradient norm to this value; -1 disables.", default=1.0)
    loss_normalization: Literal["token", "mean", "sum"] = _help(
        "token: sum of token losses over the global batch / its trained tokens (invariant to batch "
        "layout). mean: mean of micro-batch means. sum: sum of token losses.",
        default="token",
    )
    seed: int = _help("Seed for data order, mixing and model-side randomness.", default=42)
    eval_steps: Optional[int] = _help("Evaluate every this many optimizer steps (and always at the end).",
                                      default=None)
    logging_steps: int = _help("Log (metrics.jsonl, stdout, trackers) every this many optimizer steps.", default=10)
    report_to: list[str] = _help("Trackers used with --with_tracking: one or more of tensorboard, wandb; or all, "
                                 "none.", default_factory=lambda: ["tensorboard"])
    wandb_project_name: Optional[str] = _help("W&B project (default: $WANDB_PROJECT, else open_sft).", default=None)
    wandb_entity: Optional[str] = _help("W&B entity (user or team; default: W&B's own).", default=None)
    timeout: int = _help("Seconds a collective may wait (process-group timeout), e.g. for a long tokenization "
                         "on rank 0.", default=1800)
    sequence_parallel_size: int = _help(
        "DeepSpeed Ulysses sequence parallelism: N ranks compute each micro-batch together, each holding 1/N of "
        "every sequence (N divides the number of processes; needs DeepSpeed ZeRO-2/3).", default=1)
    pipeline_parallel_size: int = _help(
        "Pipeline parallelism: the decoder layers are split into N stages on N ranks (embeddings on the first, "
        "the LM head and loss on the last) run by torch.distributed.pipelining; N divides the number of "
        "processes, the rest is data parallelism. Not with DeepSpeed, FSDP2, SP, TP or QLoRA.", default=1)
    pipeline_schedule: Literal["1f1b", "gpipe", "interleaved_1f1b"] = _help(
        "Pipeline schedule: 1f1b (one forward, one backward: the least activation memory), gpipe (all forwards, "
        "then all backwards), interleaved_1f1b (--pipeline_virtual_stages stages per rank: a smaller bubble).",
        default="1f1b")
    pipeline_virtual_stages: int = _help(
        "Stages per rank under --pipeline_schedule interleaved_1f1b (rank r holds stages r, r+N, ...).", default=1)
    pipeline_layers: Optional[str] = _help(
        "Where the stages start, as the index of each stage's first decoder layer after the first stage's, e.g. "
        "'10,20,30' for 4 stages of a 40-layer model; default: layers spread evenly.", default=None)
    with_tracking: bool = _help("Write tracker logs (see --report_to) in addition to metrics.jsonl.", default=False)
    dry_run: bool = _help(
        "Build the data, print the data report, a few examples with trained tokens marked and the preflight "
        "(memory per rank, time from a probe of a few training steps on a throwaway copy), and exit: nothing "
        "is written to --output_dir.", default=False
    )
    auto_micro_batch_size: bool = _help(
        "Use the largest micro-batch (a divisor of per_device_train_batch_size × gradient_accumulation_steps) "
        "whose estimated memory fits the rank, and raise the accumulation so the global batch, and so the "
        "training math, stays the same. Not with --packing (the packing would change), --loss_normalization mean "
        "or a router load-balancing loss (both depend on the micro-batch).", default=False
    )
    max_memory_per_rank_gib: Optional[float] = _help(
        "Memory one rank may use, for the preflight warning and --auto_micro_batch_size. Default: the GPU's "
        "memory, or on CPU the machine's RAM divided by the ranks on this node.", default=None
    )


@dataclass
class CheckpointArguments:
    checkpointing_steps: Optional[str] = _help(
        "Save a resumable checkpoint to OUTPUT_DIR/checkpoints/step_N every N optimizer steps, or 'epoch' "
        "at the end of each epoch. Default: only when preempted (SIGTERM, SIGINT, SIGUSR1).", default=None
    )
    keep_last_n_checkpoints: int = _help(
        "Complete checkpoints kept; older ones are deleted (the newest complete one never is); -1 keeps all.",
        default=3
    )
    clean_checkpoints_at_end: bool = _help(
        "Delete OUTPUT_DIR/checkpoints after the model is exported (open-instruct's default; open_sft keeps them "
        "unless asked).", default=False)
    resume_from_checkpoint: str = _help(
        "auto: resume from the newest complete checkpoint in OUTPUT_DIR/checkpoints if there is one; "
        "a checkpoint directory; or none to start over (earlier checkpoints are moved aside).", default="auto")
    overwrite_output_dir: bool = _help(
        "Start over in --output_dir on purpose: train from step 0 even if a run there finished (OUTPUT_DIR/"
        "RUN_COMPLETE; without this flag a relaunch of a finished run says 'already complete' and exits 0) or left "
        "checkpoints (moved aside to checkpoints.previous-N, as with --resume_from_checkpoint none); the export is "
        "overwritten at the end; also allows a non-empty directory holding no open_sft run. Leave it out of a "
        "command a scheduler requeues: each relaunch would start over.", default=False)
    allow_changed_settings: bool = _help(
        "Resume with settings that differ from the checkpoint's in flags that alter the trained model (a new "
        "--learning_rate from here, say); without it such a resume is refused, naming each difference. The steps "
        "each set of settings trained are recorded (run.json, RUN_COMPLETE's settings_by_steps, the model card), and "
        "a relaunch of any of the recorded commands after the run completes is answered 'already complete'.",
        default=False)
    max_shard_size: str = _help("Largest safetensors file of the exported model, e.g. 5GB or 500MB.",
                                default="5GB")
    save_dtype: Literal["auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32"] = _help(
        "dtype of the exported weights: auto (the dtype of the checkpoint the run started from, as its config "
        "says: bf16 for a bf16 checkpoint; float32 where it says none), bfloat16, float16 or float32. Training "
        "keeps fp32 master weights either way.", default="auto")


@dataclass
class HubArguments:
    push_to_hub: bool = _help("Upload the exported model to the Hugging Face Hub (main process only).",
                              default=False)
    hub_model_id: Optional[str] = _help("Hub repository to push to, e.g. my-org/my-model.", default=None)
    hub_revision: str = _help("Branch of the Hub repository to push to (created if missing).", default="main")
    hub_private: bool = _help("Create the Hub repository as private.", default=True)
    hub_token: Optional[str] = _help(
        "Hub token (default: the HF_TOKEN environment variable). Never logged or written to disk.", default=None
    )
    push_checkpoints: bool = _help(
        "With --push_to_hub: upload each complete checkpoint in the background (main process) to checkpoints/step_N/"
        " of --hub_revision; a failed one warns, training goes on; pruned once uploaded (a relaunch uploads the rest).",
        default=False
    )

    def public_dict(self) -> dict[str, Any]:
        """The arguments with the token replaced, for run.json, checkpoints, trackers and model cards."""
        return redact_secrets(dataclasses.asdict(self))


DATACLASSES = (ModelArguments, DataArguments, TrainingArguments, LoraArguments, CheckpointArguments,
               HubArguments)

@dataclass
class FinetuneConfig:
    """Everything a run needs; built by `parse_config` and never mutated after validation."""

    model: ModelArguments
    data: DataArguments
    train: TrainingArguments
    lora: LoraArguments = field(default_factory=LoraArguments)
    checkpoint: CheckpointArguments = field(default_factory=CheckpointArguments)
    hub: HubArguments = field(default_factory=HubArguments)
    explicit: frozenset[str] = frozenset()
    """The settings the user gave (flags and run-YAML keys), as opposed to defaults: a given flag wins over
    a launch config's value, a default does not (open_sft.config.launch)."""
    implied: dict[str, str] = field(default_factory=dict)
    """The settings in `explicit` that no flag of the user's names but a command line implies, each with what
    implies it (`--adam_beta2`: "the OLMo-core command line sets ..."): a refusal of one says where it came from."""
    notes: tuple[str, ...] = ()
    """One line per open-instruct flag translated or ignored (open_sft.config.open_instruct), logged once at start."""
    warnings: tuple[str, ...] = ()
    """Ignored open-instruct flags that change what is trained (open_sft.config.open_instruct), logged as warnings."""

    def to_dict(self) -> dict[str, Any]:
        return {"model": dataclasses.asdict(self.model), "data": dataclasses.asdict(self.data),
                "train": dataclasses.asdict(self.train), "lora": dataclasses.asdict(self.lora),
                "checkpoint": dataclasses.asdict(self.checkpoint), "hub": self.hub.public_dict()}
