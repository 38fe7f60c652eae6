"""How much to draft, chosen while serving: K by measured goodput, the drafter gate,
and the drafting-step timer they read."""
