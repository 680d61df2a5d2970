"""8 agents with the official openai client over one declared pool.

First run: polykv serve --pool examples/design-doc.md
"""

import asyncio
from pathlib import Path

from openai import AsyncOpenAI

DOC = Path("examples/design-doc.md").read_text()
QUESTIONS = [q for q in Path("examples/agents.txt").read_text().splitlines() if q and not q.startswith("#")]


async def ask(client: AsyncOpenAI, i: int, question: str) -> None:
    r = await client.completions.create(model="polykv", prompt=f"{DOC}Question: {question}\nAnswer:", max_tokens=32)
    status, usage = r.model_extra["shared_prefix"]["status"], r.usage
    print(f"agent {i}: {status}, cached_tokens {usage.prompt_tokens_details.cached_tokens} of {usage.prompt_tokens}")


async def main() -> None:
    client = AsyncOpenAI(base_url="http://127.0.0.1:8080/v1", api_key="unused")
    await asyncio.gather(*(ask(client, i, q) for i, q in enumerate(QUESTIONS, 1)))


asyncio.run(main())
