"""The multi-tool task's agent as a plain `openai`-client program: it calls the tools itself
(search over a Search-R1 retriever, a calculator) and trains unmodified through the gateway:

    searchr1 agent run -c stack.yaml --program docs/examples/openai_agent.py:agent \
        --data rows.jsonl -n 8          # rows: {"question": ..., "answer": ...}

`search_agent` is the same program with the search tool only: the agent `searchr1 demo --agent
openai` trains (demos/agent.py).

Its trajectories equal the built-in loop's for the same turns, id for id and mask for mask
(tests/unit/gateway/test_same_as_loop.py).
"""

from __future__ import annotations

import ast
import json
import operator
import os
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from openai import AsyncOpenAI

Tool = Callable[[dict[str, Any]], Awaitable[str]]
INSTRUCTION = "Answer the question. Use search to look facts up and calculate for arithmetic. "
INSTRUCTION += "Give the final answer inside <answer> and </answer>."
SEARCH_INSTRUCTION = "Answer the question. Use search to look facts up. "
SEARCH_INSTRUCTION += "Give the final answer inside <answer> and </answer>."


def schema(name: str, description: str, argument: str) -> dict[str, Any]:
    properties = {argument: {"type": "string"}}
    parameters = {"type": "object", "properties": properties, "required": [argument]}
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": parameters}}  # fmt: skip


TOOLS = [schema("search", "Search the corpus.", "query"),
         schema("calculator", "Evaluate arithmetic.", "expression")]  # fmt: skip


async def search(arguments: dict[str, Any]) -> str:
    """The top documents (`SEARCH_TOPK`, 3) from the retriever (`RETRIEVER_URL`), as Search-R1
    renders them."""
    url = os.environ.get("RETRIEVER_URL", "http://127.0.0.1:8000") + "/retrieve"
    topk = int(os.environ.get("SEARCH_TOPK", "3"))
    body = {"queries": [arguments["query"]], "topk": topk, "return_scores": False}
    async with httpx.AsyncClient(timeout=30) as http:
        docs = (await http.post(url, json=body)).raise_for_status().json()["result"][0]
    parts = [d["contents"].partition("\n") for d in docs]
    return "".join(f"Doc {i}(Title: {t}) {text}\n" for i, (t, _, text) in enumerate(parts, 1))


OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


async def calculator(arguments: dict[str, Any]) -> str:
    def ev(n: ast.AST) -> int:
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in OPS:
            return OPS[type(n.op)](ev(n.left), ev(n.right))  # type: ignore[no-any-return]
        raise ValueError("only + - * of integers")

    return str(ev(ast.parse(arguments["expression"], mode="eval").body))


def make_agent(
    tools: dict[str, Tool],
    schemas: list[dict[str, Any]],
    max_turns: int = 3,
    instruction: str = INSTRUCTION,
    **client_kw: Any,
) -> Any:
    async def agent(base_url: str, row: dict[str, Any]) -> float:
        token = os.environ.get("SEARCHR1_ADMIN_TOKEN", "-")
        client = AsyncOpenAI(base_url=base_url, api_key=token, **client_kw)
        question = f"{instruction}\nQuestion: {row['question']}\n"
        messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
        for _ in range(max_turns):
            r = await client.chat.completions.create(model="policy", messages=messages,
                                                     tools=schemas)  # fmt: skip
            message = r.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                tool = tools.get(call.function.name)
                arguments = json.loads(call.function.arguments)
                result = await tool(arguments) if tool else f"no tool {call.function.name!r}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        answer = (messages[-1].get("content") or "").rpartition("<answer>")[2]
        return float(answer.partition("</answer>")[0].strip() == str(row["answer"]))

    return agent


agent = make_agent({"search": search, "calculator": calculator}, TOOLS)
search_agent = make_agent({"search": search}, TOOLS[:1], instruction=SEARCH_INSTRUCTION)
