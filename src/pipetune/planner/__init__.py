"""The planner: layouts, the memory and speed models at work, `pipetune plan`."""
