"""Shared inputs of the memory-API and engine tests (a module with a unique name, unlike conftest)."""

from __future__ import annotations

THREADS = 2

PREFIX_TEXT = (
    "You are one of several assistants working on the same project notes.\n"
    "Project notes:\n"
    "1. The warehouse in Lyon ships 1,200 parcels a day and closes at 18:00.\n"
    "2. The Porto office handles refunds; it answers within two working days.\n"
    "3. Every parcel heavier than 30 kg needs a second driver.\n"
    "4. The team meets on Mondays at 9:30 to plan the week.\n"
    "5. Customer complaints go to Ana; supplier questions go to Bruno.\n"
    "6. The new tracking system goes live on the first of March.\n"
    "7. Fuel costs rose by 12 percent last quarter; routes were shortened.\n"
    "8. Night shifts pay 15 percent more than day shifts.\n"
    "Answer the question that follows in one short sentence.\n"
)

SUFFIXES = [
    "Question: When does the warehouse close?\nAnswer:",
    "Question: Who handles supplier questions?\nAnswer:",
    "Question: What happens to parcels over 30 kg?\nAnswer:",
    "Question: When does the team meet?\nAnswer:",
]
