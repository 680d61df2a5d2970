"""Questions about the sample document (``design-doc.md``), each with a fact its answer should hold.

The multi-turn benchmark asks them, so every answer depends on the base context (an agent that
got the wrong KV for the base answers differently); the fact lets a report count answers that
name it.
"""

from __future__ import annotations

#: (question, a short string a correct answer contains)
QUESTIONS: tuple[tuple[str, str], ...] = (
    ("How many electric bikes does the Riverside bike-share run?", "2,400"),
    ("How many docking stations does the bike-share have?", "310"),
    ("How often does each bike report its position today?", "five minutes"),
    ("How long does the nightly rebalancing report take?", "forty minutes"),
    ("What does the current system cost to run each month?", "4,100"),
    ("How large is the binary frame a bike sends?", "96"),
    ("What share of frames was lost during reconnect bursts?", "3.1"),
    ("How many indexes does the current reports table have?", "eleven"),
    ("What share of bikes has a clock that drifts by more than a minute per week?", "6"),
    ("What are the four parts of Lanternfish?", "gateway"),
    ("After how many seconds does firmware 4.2 resend an unacknowledged frame?", "two"),
    ("How many partitions does the log have?", "24"),
    ("How long does the log keep frames?", "seven days"),
    ("How many frames per second arrive at the evening rush?", "1,900"),
    ("How many live view processes run?", "three"),
    ("How does the live view deduplicate frames?", "sequence number"),
    ("Over how many frames is the clock-skew median taken?", "fifty"),
    ("What batch size does the history store loader use?", "50,000"),
    ("When does the compaction job run?", "midnight"),
    ("Why did the team choose one wide table?", "join"),
    ("With how many decimal places are positions stored?", "seven"),
    ("How long is the deprecation notice for a renamed field?", "ninety days"),
    ("For what rate is every component sized?", "5,700"),
    ("What is the estimated total monthly cost of Lanternfish?", "3,620"),
    ("How many hosts does the history store use?", "4"),
    ("How quickly does anycast move frames to the other gateway?", "ten seconds"),
    ("When does the dashboard turn amber?", "thirty seconds"),
    ("After how long without a successful batch does the loader alert fire?", "fifteen minutes"),
    ("How long are positions of bikes in use kept at full precision?", "thirty days"),
    ("To what grid are old positions rounded?", "150"),
    ("How long do the old and new systems run side by side?", "four weeks"),
    ("By how much will hosting prices rise next spring?", "8 percent"),
)
