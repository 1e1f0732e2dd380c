"""The run config: structured configs (`diffalign.config.schemas`), the field checks every component shares
(`diffalign.config.checks`), the checks of a composed config (`diffalign.config.validation`), plugin discovery into
Hydra's ConfigStore (`diffalign.config.registry`) and composing (`diffalign.config.compose`). Components import this
package; it imports no component (their checks register themselves, `diffalign.config.checks.node_check`)."""
