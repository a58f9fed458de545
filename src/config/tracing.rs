//! `tracing:`: OpenTelemetry traces, off unless the section is given.

use serde::Deserialize;

/// `tracing:` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(expecting = "tracing: a mapping with otlp_endpoint, sample_ratio and service_name")]
pub(crate) struct RawTracing {
    /// The collector's OTLP/HTTP base URL; spans are posted (protobuf) to `/v1/traces` under
    /// it. Required.
    pub otlp_endpoint: String,
    /// The share of requests without a `traceparent` that are recorded, from 0 to 1; a
    /// client's `traceparent` decides for its own request. Default 0.01.
    #[serde(default = "defaults::sample_ratio")]
    pub sample_ratio: f64,
    /// `service.name` of every span. Default `idemproxy`.
    #[serde(default = "defaults::service_name")]
    pub service_name: String,
}

/// Where and how much to trace: the validated `tracing:` section.
#[derive(Debug, Clone, PartialEq)]
pub struct TracingSettings {
    /// The collector's OTLP/HTTP base URL (`http://` or `https://`).
    pub otlp_endpoint: String,
    /// From 0 to 1.
    pub sample_ratio: f64,
    pub service_name: String,
}

mod defaults {
    pub(super) fn sample_ratio() -> f64 {
        0.01
    }

    pub(super) fn service_name() -> String {
        "idemproxy".to_owned()
    }
}

impl RawTracing {
    /// Checks the endpoint's scheme and the ratio's range.
    pub(crate) fn validate(&self, err: &mut impl FnMut(String, String)) -> Option<TracingSettings> {
        let mut ok = true;
        let endpoint = self.otlp_endpoint.trim();
        let scheme_ok = endpoint.starts_with("http://") || endpoint.starts_with("https://");
        if !scheme_ok || endpoint.parse::<http::Uri>().is_err() {
            err(
                "tracing.otlp_endpoint".into(),
                format!(
                    "invalid endpoint {:?}; expected an http:// or https:// URL such as http://127.0.0.1:4318",
                    self.otlp_endpoint
                ),
            );
            ok = false;
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            err(
                "tracing.sample_ratio".into(),
                format!("{} is outside 0..=1", self.sample_ratio),
            );
            ok = false;
        }
        if self.service_name.trim().is_empty() {
            err("tracing.service_name".into(), "must not be empty".into());
            ok = false;
        }
        ok.then(|| TracingSettings {
            otlp_endpoint: endpoint.to_owned(),
            sample_ratio: self.sample_ratio,
            service_name: self.service_name.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn with(tracing: &str) -> Result<Config, crate::config::ConfigErrors> {
        Config::from_yaml(&format!(
            "listen: 127.0.0.1:0\nupstreams: {{u: {{url: http://127.0.0.1:9}}}}\nroutes: [{{name: r, path: /, upstream: u}}]\n{tracing}"
        ))
    }

    #[test]
    fn tracing_is_off_unless_given_and_defaults_otherwise() {
        assert_eq!(with("").expect("valid").tracing, None);
        let on = with("tracing: {otlp_endpoint: http://127.0.0.1:4318}")
            .expect("valid")
            .tracing
            .expect("on");
        assert_eq!(on.sample_ratio, 0.01);
        assert_eq!(on.service_name, "idemproxy");
    }

    #[test]
    fn a_ratio_outside_0_1_an_endpoint_not_http_and_unknown_fields_are_refused() {
        let errors = with("tracing: {otlp_endpoint: grpc://c:4317, sample_ratio: 1.5}")
            .expect_err("invalid")
            .to_string();
        assert!(errors.contains("tracing.otlp_endpoint"), "{errors}");
        assert!(errors.contains("tracing.sample_ratio"), "{errors}");
        let errors = with("tracing: {otlp_endpoint: http://c:4318, sample_ratio: -0.1}")
            .expect_err("invalid")
            .to_string();
        assert!(errors.contains("tracing.sample_ratio"), "{errors}");
        let errors = with("tracing: {otlp_endpoint: http://c:4318, ratio: 1}")
            .expect_err("invalid")
            .to_string();
        assert!(errors.contains("ratio"), "{errors}");
    }
}
