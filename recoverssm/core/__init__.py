"""Device-agnostic core: public API, validation, types, the plan rules, registry and hook specs."""
