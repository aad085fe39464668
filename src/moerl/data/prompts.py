"""Prompt templates: the text a policy sees before it answers, and the ids that end its answer."""
from __future__ import annotations

from dataclasses import dataclass

import torch

TEMPLATES = {
    # The synthetic task is its own prompt: "12+3*4=" -> "\boxed{24}".
    "arith": "{question}",
    # Worked arithmetic: "12+3*4-5=" -> "3*4=12;12+12=24;24-5=19;\boxed{19}".
    "arith_steps": "{question}",
    # Real datasets: the model is asked to finish with a boxed answer, which the reward parses.
    "gsm8k": "Question: {question}\nPut the final answer in \\boxed{{}}.\nAnswer: ",
    "math": "Problem: {question}\nPut the final answer in \\boxed{{}}.\nSolution: ",
}


def render_prompt(task: str, question: str) -> str:
    try:
        template = TEMPLATES[task]
    except KeyError:
        raise ValueError(f"no prompt template for task '{task}' (have: {sorted(TEMPLATES)})") from None
    return template.format(question=question)


def render_target(answer: str, worked: str | None = None) -> str:
    """What the warm start teaches the policy to write after the prompt (a worked solution if the task
    has one, else the boxed answer)."""
    return worked if worked is not None else f"\\boxed{{{answer}}}"


# What a checkpoint's prompt asks for, as verl's preprocessing scripts ask it (examples/data_preprocess/gsm8k.py,
# math_dataset.py): GSM8K answers after "####", MATH answers in \boxed{}.
INSTRUCTIONS = {
    "gsm8k": 'Let\'s think step by step and output the final answer after "####".',
    "math": "Let's think step by step and output the final answer within \\boxed{}.",
    "arith": "Output the final answer within \\boxed{}.",
    "arith_steps": "Output the final answer within \\boxed{}.",
}


@dataclass(frozen=True)
class PromptFormat:
    """How questions become prompt ids for one tokenizer, and which ids end a response.

    The tiny presets' character tokenizer reads ``<bos>`` + the task's template; a checkpoint's tokenizer
    reads the question followed by the instruction, rendered by its chat template (or as plain text with
    the tokenizer's own special tokens when ``chat_template`` is false)."""

    task: str
    checkpoint: bool = False
    chat_template: bool = True
    instruction: str | None = None
    stop_ids: tuple[int, ...] = ()

    @property
    def answers_after_hashes(self) -> bool:
        """Whether responses may end in ``#### n`` (GSM8K's own answer format) as well as ``\\boxed{n}``."""
        return self.checkpoint and self.task == "gsm8k"

    def user_message(self, question: str) -> str:
        return f"{question} {self.instruction or INSTRUCTIONS[self.task]}"

    def texts(self, tokenizer, questions: list[str]) -> list[str]:
        if not self.checkpoint:
            from moerl.data.tokenizer import BOS

            return [BOS + render_prompt(self.task, q) for q in questions]
        if not self.chat_template:
            return [self.user_message(q) for q in questions]
        return [tokenizer.apply_chat_template([{"role": "user", "content": self.user_message(q)}],
                                              add_generation_prompt=True, tokenize=False) for q in questions]

    def encode(self, tokenizer, questions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompt ids and mask. A chat template writes its own special tokens; plain text gets
        the tokenizer's (its BOS, where it has one)."""
        enc = tokenizer(self.texts(tokenizer, questions), return_tensors="pt", padding=True,
                        add_special_tokens=self.checkpoint and not self.chat_template)
        return enc.input_ids, enc.attention_mask

    def token_ids(self, tokenizer, questions: list[str]) -> list[list[int]]:
        """Unpadded prompt ids, one list per question (what vLLM takes)."""
        add = self.checkpoint and not self.chat_template
        return [tokenizer(text, add_special_tokens=add).input_ids for text in self.texts(tokenizer, questions)]

    def stops(self, tokenizer) -> list[int]:
        return list(self.stop_ids) or [tokenizer.eos_token_id]


def prompt_format(task_or_format: "str | PromptFormat") -> PromptFormat:
    """A PromptFormat from a task name (the tiny presets' prompts) or itself."""
    return task_or_format if isinstance(task_or_format, PromptFormat) else PromptFormat(task_or_format)
