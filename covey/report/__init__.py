"""Reading run folders back: the compare runner, the report and its claims, figures and plots."""
