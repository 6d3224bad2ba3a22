//! Configs from Python: a TOML text or a JSON object (the vLLM tier's entry), parsed and
//! checked as the engine parses them, and kvtier's errors as Python exceptions.

use kvtier::{Config, ConfigError as RustConfigError, Error as RustError};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::{BackpressureError, ConfigError, Error, ShutdownError};

pub(crate) fn to_py(err: RustError) -> PyErr {
    match err {
        RustError::Config(e) => ConfigError::new_err(e.to_string()),
        RustError::Backpressure(m) => BackpressureError::new_err(format!("backpressure: {m}")),
        RustError::Shutdown => ShutdownError::new_err("the engine is shut down"),
        RustError::InvalidKey(m) => PyValueError::new_err(format!("invalid key: {m}")),
        other => Error::new_err(other.to_string()),
    }
}

#[allow(clippy::needless_pass_by_value)] // used as `map_err(config_err)`
pub(crate) fn config_err(err: RustConfigError) -> PyErr {
    ConfigError::new_err(err.to_string())
}

/// JSON (what Python's `json.dumps` makes of a dict) to TOML, so a dict config goes through the
/// same parser and validation as a file. `null` means "not set" and is left out.
pub(crate) fn json_to_toml(
    field: &str,
    value: serde_json::Value,
) -> Result<Option<toml::Value>, PyErr> {
    use serde_json::Value as J;
    Ok(match value {
        J::Null => None,
        J::Bool(b) => Some(toml::Value::Boolean(b)),
        J::Number(n) => Some(if let Some(i) = n.as_i64() {
            toml::Value::Integer(i)
        } else if let (true, Some(f)) = (n.is_f64(), n.as_f64()) {
            toml::Value::Float(f)
        } else {
            return Err(ConfigError::new_err(format!(
                "config field `{field}` = {n}: a number TOML can hold (at most {})",
                i64::MAX
            )));
        }),
        J::String(s) => Some(toml::Value::String(s)),
        J::Array(items) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.into_iter().enumerate() {
                let name = format!("{field}[{i}]");
                let Some(v) = json_to_toml(&name, item)? else {
                    return Err(ConfigError::new_err(format!(
                        "config field `{name}` = None: a list may not hold None"
                    )));
                };
                out.push(v);
            }
            Some(toml::Value::Array(out))
        }
        J::Object(map) => {
            let mut table = toml::map::Map::new();
            for (k, v) in map {
                let name = if field.is_empty() {
                    k.clone()
                } else {
                    format!("{field}.{k}")
                };
                if let Some(v) = json_to_toml(&name, v)? {
                    table.insert(k, v);
                }
            }
            Some(toml::Value::Table(table))
        }
    })
}

/// Parses a config given as `kind` = "path", "toml" or "json" (a dict serialized by Python).
pub(crate) fn parse_config(config: &str, kind: &str) -> PyResult<Config> {
    match kind {
        "path" => Config::from_file(std::path::Path::new(config)).map_err(config_err),
        "toml" => Config::from_toml_str(config).map_err(config_err),
        "json" => {
            let value: serde_json::Value = serde_json::from_str(config)
                .map_err(|e| ConfigError::new_err(format!("config: not a JSON table: {e}")))?;
            if !value.is_object() {
                return Err(ConfigError::new_err("config: the dict must be a table"));
            }
            let table =
                json_to_toml("", value)?.unwrap_or(toml::Value::Table(toml::map::Map::new()));
            let text = toml::to_string(&table)
                .map_err(|e| ConfigError::new_err(format!("config: {e}")))?;
            Config::from_toml_str(&text).map_err(config_err)
        }
        other => Err(PyValueError::new_err(format!(
            "config kind {other:?}: expected \"path\", \"toml\" or \"json\""
        ))),
    }
}

/// Validates a config (path, TOML text or JSON of a dict) and returns it as TOML, defaults
/// filled in.
#[pyfunction]
#[pyo3(signature = (config, kind))]
pub(crate) fn check_config(config: &str, kind: &str) -> PyResult<String> {
    Ok(parse_config(config, kind)?.to_toml_string())
}

/// A size such as `"2 MiB"` or `"4096"` in bytes, parsed as the config parses sizes.
#[pyfunction]
pub(crate) fn parse_size(text: &str) -> PyResult<u64> {
    kvtier::config::parse_size(text)
        .map_err(|e| ConfigError::new_err(format!("size {text:?}: {e}")))
}
