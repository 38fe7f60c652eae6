"""Chat questions of mixed kinds and lengths: the soak workload and the end-to-end tests."""

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Translate to Spanish: The cat sleeps on the warm windowsill.",
    "If a train travels 60 miles per hour for 3 hours, how far does it go?",
    "Hi! How are you today?",
    "List five fruits that are red.",
    "Explain what a hash table is in two sentences.",
    "Tom has 12 apples and gives away 5. How many are left? Explain step by step.",
    "Write a haiku about the sea.",
    "What does HTTP stand for?",
    "Translate to Spanish: In the beginning God created the heaven and the earth.",
    "Summarize the following text in one sentence: " + " ".join(
        ["The committee met on Monday to discuss the budget for the coming year."] * 12),
    "Give me a recipe for pancakes.",
    "def add(a, b):\n    return a + b\n\nExplain this code and write a test for it.",
    "Why is the sky blue?",
    "Tell me a short story about a robot who learns to paint. " * 6,
]
