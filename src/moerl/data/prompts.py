"""Prompt templates: the text a policy sees before it answers."""
from __future__ import annotations

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
