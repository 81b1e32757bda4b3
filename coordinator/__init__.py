"""The service layer: the scheduler, router, drafter pool, supervision, the Ray service and the
gRPC and HTTP front ends. Each name is imported from its own module: the rule and sampling from
`specd_core`, the in-process decode loop from `coordinator.step.speculative`."""
