use std::path::Path;

use super::*;

const ONE_DEVICE: &str = "[[devices]]\npath = \"/dev/nvme0n1\"\n";

/// Parses `text` followed by one valid device and returns the error text; panics if it
/// parsed.
fn error_with_device(text: &str) -> String {
    error_of(&format!("{text}\n{ONE_DEVICE}"))
}

fn error_of(text: &str) -> String {
    match Config::from_toml_str(text) {
        Ok(config) => panic!("expected an error, parsed {config:?}"),
        Err(err) => err.to_string(),
    }
}

fn assert_mentions(message: &str, parts: &[&str]) {
    for part in parts {
        assert!(message.contains(part), "`{part}` missing from: {message}");
    }
}

// The documented defaults, both for `Config::default` and for a file that sets nothing but
// a device; a changed default would silently change every deployment's behaviour.
#[test]
fn defaults() {
    let d = Config::default();
    assert_eq!(d.block_size, 2 * MIB);
    assert_eq!(d.cores, Cores::Auto);
    assert_eq!(d.hugepages, HugePages::Auto);
    assert_eq!(d.region_blocks, 256);
    assert_eq!(d.direct_io, DirectIo::Auto);
    assert_eq!(d.ring_entries, 256);
    assert!(!d.sqpoll);
    assert_eq!(d.sqpoll_idle_ms, 1000);
    assert!(!d.iopoll);
    assert_eq!(d.io_timeout_ms, 10_000);
    assert_eq!(d.queue_blocks_max, 65536);
    assert_eq!(d.jobs_in_flight_max, 8192);
    assert_eq!(d.scheduler.load_inflight_max, 64);
    assert_eq!(d.scheduler.store_inflight_max, 64 * MIB);
    assert_eq!(d.scheduler.store_inflight_max_while_loading, 512 * KIB);
    assert_eq!(d.scheduler.store_chunk_bytes, 512 * KIB);
    assert!(d.scheduler.ioprio);
    assert!(!d.events.enabled);
    assert_eq!(d.events.max, 65536);
    assert_eq!(d.events.locality, None);
    assert!(d.devices.is_empty());

    let parsed = Config::from_toml_str(ONE_DEVICE).expect("minimal config");
    let expected = Config {
        devices: vec![DeviceConfig::new("/dev/nvme0n1")],
        ..Config::default()
    };
    assert_eq!(parsed, expected);
    assert_eq!(parsed.devices[0].layout, Layout::Slab);
    assert_eq!(parsed.devices[0].capacity_bytes, None);
    assert!(!parsed.devices[0].overwrite);
}

// Every accepted size spelling, including fractions and decimal units; a regression here
// would misread the capacity or block size an operator wrote.
#[test]
fn sizes_parse() {
    let good: &[(&str, u64)] = &[
        ("4096", 4096),
        ("0", 0),
        ("2 MiB", 2 * MIB),
        ("512KiB", 512 * KIB),
        ("1 GiB", GIB),
        ("1.5 GiB", 3 * GIB / 2),
        ("0.5 KiB", 512),
        ("1.50 MiB", 3 * MIB / 2),
        ("2 mib", 2 * MIB),
        ("2 MIB", 2 * MIB),
        ("4K", 4 * KIB),
        ("3 m", 3 * MIB),
        ("1 G", GIB),
        ("2T", 2 * TIB),
        ("1 TiB", TIB),
        ("1 KB", 1000),
        ("1.5 kb", 1500),
        ("2 MB", 2_000_000),
        ("1GB", 1_000_000_000),
        ("1 TB", 1_000_000_000_000),
        ("100 B", 100),
        ("100b", 100),
        ("  7   MiB  ", 7 * MIB),
        ("18446744073709551615", u64::MAX),
    ];
    for &(text, bytes) in good {
        assert_eq!(parse_size(text), Ok(bytes), "{text:?}");
    }
    let bad: &[(&str, SizeError)] = &[
        ("", SizeError::Malformed),
        ("GiB", SizeError::Malformed),
        (".5 GiB", SizeError::Malformed),
        ("1. GiB", SizeError::Malformed),
        ("1.2.3 MiB", SizeError::Malformed),
        ("1.5", SizeError::NotWholeBytes),
        ("0.3 KiB", SizeError::NotWholeBytes),
        ("2 XB", SizeError::UnknownUnit("XB".into())),
        ("-1 MiB", SizeError::Malformed),
        ("1e3", SizeError::UnknownUnit("e3".into())),
        ("2 Mi B", SizeError::UnknownUnit("Mi B".into())),
        ("16 EiB", SizeError::UnknownUnit("EiB".into())),
        ("18446744073709551616", SizeError::TooLarge),
        ("16777216 TiB", SizeError::TooLarge),
        (
            "99999999999999999999999999999999999999999 B",
            SizeError::TooLarge,
        ),
    ];
    for (text, err) in bad {
        assert_eq!(parse_size(text).as_ref(), Err(err), "{text:?}");
    }
}

// Sizes inside a config: integer and string forms are read, and a bad one names its dotted
// field (with the device index) and shows the accepted spellings.
#[test]
fn sizes_in_config() {
    let config = Config::from_toml_str(
        "block_size = 8192\n[scheduler]\nstore_chunk_bytes = \"64KiB\"\n\
         [[devices]]\npath = \"/a\"\ncapacity_bytes = \"1.5 GiB\"\n",
    )
    .expect("valid sizes");
    assert_eq!(config.block_size, 8192);
    assert_eq!(config.scheduler.store_chunk_bytes, 64 * KIB);
    assert_eq!(config.devices[0].capacity_bytes, Some(3 * GIB / 2));

    let message = error_with_device("block_size = \"2 XB\"");
    assert_mentions(
        &message,
        &["`block_size`", "\"2 XB\"", "unknown unit `XB`", "512 KiB"],
    );
    let message = error_with_device("[scheduler]\nstore_chunk_bytes = \"lots\"");
    assert_mentions(
        &message,
        &["`scheduler.store_chunk_bytes`", "\"lots\"", "1.5 GiB"],
    );
    let message = error_with_device("block_size = 1.5");
    assert_mentions(&message, &["`block_size`", "1.5", "a float", "\"2 MiB\""]);
    let message = error_with_device("block_size = -4096");
    assert_mentions(&message, &["`block_size`", "-4096", "negative"]);
    let message = error_of(&format!(
        "{ONE_DEVICE}[[devices]]\npath = \"/b\"\ncapacity_bytes = \"3.3 B\"\n"
    ));
    assert_mentions(
        &message,
        &[
            "`devices[1].capacity_bytes`",
            "\"3.3 B\"",
            "whole number of bytes",
        ],
    );
    let message = error_of(&format!(
        "{ONE_DEVICE}[[devices]]\npath = \"/b\"\ncapacity_bytes = \"1 MiB\"\n"
    ));
    assert_mentions(
        &message,
        &["`devices[1].capacity_bytes`", "\"1 MiB\"", "16 MiB"],
    );
}

// Misspelt keys at each level must be refused, naming the key and its line, so a typo
// never falls back to a default unnoticed.
#[test]
fn unknown_keys() {
    let message = error_with_device("block_sise = \"2 MiB\"");
    assert_mentions(&message, &["block_sise", "line 1", "block_size"]);
    let message = error_with_device("[scheduler]\nioprio = true\nload_inflight = 3");
    assert_mentions(&message, &["load_inflight", "line 3", "load_inflight_max"]);
    let message = error_of("[[devices]]\npath = \"/a\"\ncapacity = \"1 GiB\"\n");
    assert_mentions(&message, &["capacity", "line 3", "capacity_bytes"]);
    let message = error_with_device("[events]\nlimit = 5");
    assert_mentions(&message, &["limit", "line 2"]);
}

// A bad enum value names the field, shows the value and lists every accepted spelling.
#[test]
fn bad_enum_value() {
    let message = error_with_device("hugepages = \"sometimes\"");
    assert_mentions(
        &message,
        &[
            "`hugepages`",
            "\"sometimes\"",
            "\"required\"",
            "\"auto\"",
            "\"off\"",
        ],
    );
    let message = error_with_device("direct_io = true");
    assert_mentions(&message, &["`direct_io`", "true", "\"required\""]);
    let message = error_of("[[devices]]\npath = \"/a\"\nlayout = \"log\"\n");
    assert_mentions(
        &message,
        &["`devices[0].layout`", "\"log\"", "\"slab\"", "\"files\""],
    );
    let config = Config::from_toml_str(
        "[[devices]]\npath = \"/a\"\nlayout = \"files\"\n[files.namespace]\nmodel_name = \"m\"\n\
         dtype = \"float16\"\ntokens_per_hash = 16\nblocks_per_file = 1\nkv_cache_groups = []\n",
    )
    .expect("files layout is accepted");
    assert_eq!(config.devices[0].layout, Layout::Files);
}

// Blocks are read with O_DIRECT, so their size must be a multiple of 4 KiB within bounds.
#[test]
fn block_size_alignment() {
    let message = error_with_device("block_size = 6000");
    assert_mentions(&message, &["`block_size`", "= 6000", "multiple of 4096"]);
    let message = error_with_device("block_size = \"2 GiB\"");
    assert_mentions(&message, &["`block_size`", "\"2 GiB\"", "1 GiB"]);
    let message = error_with_device("block_size = \"1 KiB\"");
    assert_mentions(&message, &["`block_size`", "\"1 KiB\""]);
}

// The ring size must be a power of two the kernel accepts.
#[test]
fn ring_entries_power_of_two() {
    let message = error_with_device("ring_entries = 100");
    assert_mentions(&message, &["`ring_entries`", "= 100", "power of two"]);
    let message = error_with_device("ring_entries = 65536");
    assert_mentions(&message, &["`ring_entries`", "65536", "32768"]);
    let message = error_with_device("ring_entries = 4");
    assert_mentions(&message, &["`ring_entries`", "= 4"]);
    let message = error_with_device("ring_entries = 5000000000");
    assert_mentions(&message, &["`ring_entries`", "5000000000", "power of two"]);
    let message = error_with_device("ring_entries = 64\n[scheduler]\nload_inflight_max = 65");
    assert_mentions(
        &message,
        &["`scheduler.load_inflight_max`", "= 65", "ring_entries (64)"],
    );
}

// Worker placement: an empty list would start no worker and a duplicate would pin two
// workers to one CPU, so both are refused; "auto" and a plain list are read.
#[test]
fn cores_list() {
    let message = error_with_device("cores = []");
    assert_mentions(&message, &["`cores`", "= []", "non-empty"]);
    let message = error_with_device("cores = [0, 1, 0]");
    assert_mentions(
        &message,
        &["`cores`", "[0, 1, 0]", "0 is listed more than once"],
    );
    let message = error_with_device("cores = [0, 2000]");
    assert_mentions(&message, &["`cores[1]`", "2000", "1023"]);
    let message = error_with_device("cores = [0, -1]");
    assert_mentions(&message, &["`cores[1]`", "-1"]);
    let message = error_with_device("cores = \"all\"");
    assert_mentions(&message, &["`cores`", "\"all\"", "\"auto\""]);
    let config = Config::from_toml_str(&format!("cores = [3, 1]\n{ONE_DEVICE}")).expect("list");
    assert_eq!(config.cores, Cores::List(vec![3, 1]));
    let config = Config::from_toml_str(&format!("cores = \"auto\"\n{ONE_DEVICE}")).expect("auto");
    assert_eq!(config.cores, Cores::Auto);
}

// The stores' budget while loading is a share of the full budget, and both must hold at
// least one chunk, or stores could never be issued.
#[test]
fn scheduler_store_budgets() {
    let message = error_with_device(
        "[scheduler]\nstore_inflight_max = \"4 MiB\"\n\
         store_inflight_max_while_loading = \"8 MiB\"",
    );
    assert_mentions(
        &message,
        &[
            "`scheduler.store_inflight_max_while_loading`",
            "\"8 MiB\"",
            "\"4 MiB\"",
        ],
    );
    let message = error_with_device("[scheduler]\nstore_inflight_max = \"256 KiB\"");
    assert_mentions(
        &message,
        &[
            "`scheduler.store_inflight_max`",
            "\"256 KiB\"",
            "\"512 KiB\"",
        ],
    );
    let message = error_with_device("[scheduler]\nstore_chunk_bytes = 1000");
    assert_mentions(
        &message,
        &[
            "`scheduler.store_chunk_bytes`",
            "= 1000",
            "multiple of 4096",
        ],
    );
}

// A config without devices has nowhere to put blocks.
#[test]
fn missing_devices() {
    let message = error_of("block_size = \"2 MiB\"\n");
    assert_mentions(
        &message,
        &["`devices`", "[]", "at least one [[devices]] entry"],
    );
    let message = error_of("[[devices]]\nlayout = \"slab\"\n");
    assert_mentions(&message, &["`devices[0].path`", "(missing)"]);
}

// Two entries with one path would format the same file twice.
#[test]
fn duplicate_device_paths() {
    let message = error_of(&format!(
        "{ONE_DEVICE}[[devices]]\npath = \"/x\"\n{ONE_DEVICE}"
    ));
    assert_mentions(
        &message,
        &["`devices[2].path`", "\"/dev/nvme0n1\"", "devices[0]"],
    );
}

// Locality is spelt as vLLM spells it; lower case must not be accepted.
#[test]
fn locality_is_upper_case() {
    let message = error_with_device("[events]\nlocality = \"local\"");
    assert_mentions(
        &message,
        &["`events.locality`", "\"local\"", "\"LOCAL\"", "\"REMOTE\""],
    );
    let config = Config::from_toml_str(&format!("[events]\nlocality = \"REMOTE\"\n{ONE_DEVICE}"))
        .expect("upper case locality");
    assert_eq!(config.events.locality, Some(Locality::Remote));
}

// Wrongly typed scalars name their field: a quoted boolean or a negative count.
#[test]
fn wrong_types() {
    let message = error_with_device("sqpoll = \"yes\"");
    assert_mentions(&message, &["`sqpoll`", "\"yes\"", "true or false"]);
    let message = error_with_device("[scheduler]\nioprio = 1");
    assert_mentions(&message, &["`scheduler.ioprio`", "= 1"]);
    let message = error_with_device("queue_blocks_max = -1");
    assert_mentions(&message, &["`queue_blocks_max`", "-1", "at least 1"]);
    let message = error_with_device("jobs_in_flight_max = 0");
    assert_mentions(&message, &["`jobs_in_flight_max`", "= 0"]);
    let message = error_with_device("[events]\nmax = 0");
    assert_mentions(&message, &["`events.max`", "= 0"]);
    let message = error_with_device("region_blocks = 0");
    assert_mentions(&message, &["`region_blocks`", "= 0"]);
    let message = error_with_device("scheduler = 3");
    assert_mentions(&message, &["scheduler", "[scheduler] table"]);
}

// The shipped example must stay loadable and keep the values it documents.
#[test]
fn example_file_parses() {
    let text = include_str!("../../kvtier.example.toml");
    let config = Config::from_toml_str(text).expect("example config");
    assert_eq!(config.block_size, 2 * MIB);
    assert_eq!(config.cores, Cores::Auto);
    assert_eq!(config.ring_entries, 256);
    assert_eq!(config.scheduler.store_inflight_max, 64 * MIB);
    assert_eq!(config.scheduler.store_chunk_bytes, 512 * KIB);
    assert!(config.scheduler.ioprio);
    assert!(!config.events.enabled);
    assert_eq!(config.devices.len(), 1);
    assert_eq!(config.devices[0].path, Path::new("/var/lib/kvtier/slab0"));
    assert_eq!(config.devices[0].layout, Layout::Slab);
    assert_eq!(config.devices[0].capacity_bytes, Some(64 * GIB));
    assert!(!config.devices[0].overwrite);
    // Every key the engine knows is documented, set or commented out.
    let mut full = Config::bench_default(Path::new("/tmp"));
    full.events.locality = Some(Locality::Local);
    for line in full.to_toml_string().lines() {
        if let Some((key, _)) = line.split_once(" = ") {
            let documented = text.lines().any(|l| {
                l.trim_start_matches(['#', ' '])
                    .starts_with(&format!("{key} ="))
            });
            assert!(documented, "key `{key}` missing from kvtier.example.toml");
        }
    }
}

// Printing the effective config and reading it back, through `from_toml_str` and through
// serde directly, must give the same config; otherwise the printout would lie.
#[test]
fn toml_round_trip() {
    let mut config = Config::bench_default(Path::new("/srv/kv"));
    config.cores = Cores::List(vec![2, 3]);
    config.hugepages = HugePages::Required;
    config.block_size = 3 * 4096;
    config.scheduler.store_inflight_max = 5 * MIB / 2;
    config.events.locality = Some(Locality::Local);
    config.devices.push(DeviceConfig {
        path: "/dev/nvme1n1".into(),
        layout: Layout::Slab,
        kind: DeviceKind::Nvme,
        capacity_bytes: Some(20_000_000),
        overwrite: true,
        pci: None,
        nsid: 1,
    });
    config.files = Some(FilesConfig {
        namespace: crate::config::Namespace::new("org/m", "bfloat16", 16, 2),
        sync: SyncMode::Data,
        temp_grace_secs: 60,
        checksums: false,
        file_mode: 0o640,
        dir_mode: 0o750,
        first_lookup: FirstLookup::Pending,
        lookup_cache_max: 100,
        lookup_ttl_ms: 250,
        io_wq_workers: 4,
        stores_opening: 3,
    });
    config.validate().expect("valid");
    let text = config.to_toml_string();
    assert!(text.contains("block_size = \"12 KiB\""), "{text}");
    assert!(text.contains("capacity_bytes = \"1 GiB\""), "{text}");
    assert!(text.contains("store_inflight_max = \"2560 KiB\""), "{text}");
    assert!(text.contains("capacity_bytes = 20000000"), "{text}");
    assert!(text.contains("file_mode = \"0640\""), "{text}");
    assert!(text.contains("dir_mode = \"0750\""), "{text}");
    assert!(text.contains("locality = \"LOCAL\""), "{text}");
    assert_eq!(
        Config::from_toml_str(&text).expect("printed config"),
        config
    );
    assert_eq!(toml::from_str::<Config>(&text).expect("serde path"), config);
}

// The bench default is valid as is and puts its slab in the given directory.
#[test]
fn bench_default_is_valid() {
    let config = Config::bench_default(Path::new("/tmp/bench"));
    config.validate().expect("bench default validates");
    assert_eq!(config.devices.len(), 1);
    assert_eq!(
        config.devices[0].path,
        Path::new("/tmp/bench/kvtier-bench.slab")
    );
    assert_eq!(config.devices[0].capacity_bytes, Some(GIB));
    assert_eq!(config.devices[0].layout, Layout::Slab);
}

// A missing file is reported with its path.
#[test]
fn from_file_names_path() {
    let path = Path::new("/nonexistent/kvtier-config-test.toml");
    let err = Config::from_file(path).expect_err("no such file");
    assert!(matches!(err, ConfigError::Io { .. }));
    assert_mentions(&err.to_string(), &["/nonexistent/kvtier-config-test.toml"]);
}

// The names used in error messages must be exactly those serde reads and writes.
#[test]
fn enum_names_match_serde() {
    fn check<T: Named + Serialize + fmt::Debug + fmt::Display>() {
        for &choice in T::ALL {
            let value = Value::try_from(choice).expect("enum serializes");
            assert_eq!(value.as_str(), Some(choice.name()), "{choice:?}");
            assert_eq!(choice.to_string(), choice.name());
        }
    }
    check::<HugePages>();
    check::<DirectIo>();
    check::<VerifyLoads>();
    check::<Layout>();
    check::<DeviceKind>();
    check::<Locality>();
}

const S3_NS: &str = "[s3.namespace]\nmodel_name = \"m\"\ndtype = \"bfloat16\"\n\
                     tokens_per_hash = 16\nblocks_per_file = 1\n\
                     kv_cache_groups = [{ tokens_per_block = 16, layer_names = [\"l\"] }]\n";

fn with_s3(lines: &str) -> Result<Config, ConfigError> {
    Config::from_toml_str(&format!("{ONE_DEVICE}[s3]\n{lines}\n{S3_NS}"))
}

#[test]
fn s3_defaults_and_values() {
    let c = with_s3("bucket = \"kv-cache\"").expect("minimal [s3]");
    let s3 = c.s3.expect("s3 section");
    assert_eq!(s3.bucket, "kv-cache");
    assert_eq!(s3.endpoint, None);
    assert_eq!(s3.region, "us-east-1");
    assert!(!s3.force_path_style);
    assert_eq!(
        (s3.max_concurrency, s3.timeout_ms, s3.retries),
        (32, 5000, 3)
    );
    assert_eq!((s3.write, s3.write_ack), (S3Write::Off, WriteAck::Both));
    assert!(s3.promote_on_load);
    assert_eq!(s3.prefix, "");
    assert_eq!(s3.namespace.model_name, "m");
    let c = with_s3(
        "bucket = \"b-1\"\nendpoint = \"http://127.0.0.1:9000/\"\nwrite = \"on_evict\"\n\
         write_ack = \"nvme\"\nprefix = \"kv/\"\nretries = 0",
    )
    .expect("[s3] with values");
    let s3 = c.s3.expect("s3");
    assert_eq!(s3.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
    assert_eq!((s3.write, s3.write_ack), (S3Write::OnEvict, WriteAck::Nvme));
    assert_eq!((s3.prefix.as_str(), s3.retries), ("kv/", 0));
    // The namespace falls back to [files.namespace].
    let text = format!(
        "{ONE_DEVICE}[s3]\nbucket = \"b-1\"\n[files.namespace]\nmodel_name = \"f\"\n\
         dtype = \"x\"\ntokens_per_hash = 16\nblocks_per_file = 1\nkv_cache_groups = []\n"
    );
    let c = Config::from_toml_str(&text).expect("namespace from [files]");
    assert_eq!(c.s3.expect("s3").namespace.model_name, "f");
}

#[test]
fn s3_errors_name_field_value_and_accepted() {
    let e = |lines: &str| with_s3(lines).expect_err("invalid [s3]").to_string();
    assert_mentions(&e("region = \"x\""), &["s3.bucket", "(missing)"]);
    assert_mentions(
        &e("bucket = \"b\"\nwrite = \"sometimes\""),
        &[
            "s3.write",
            "sometimes",
            "\"through\"",
            "\"on_evict\"",
            "\"off\"",
        ],
    );
    assert_mentions(
        &e("bucket = \"b\"\nendpoint = \"127.0.0.1:9000\""),
        &["s3.endpoint", "127.0.0.1:9000", "http://"],
    );
    let message = e("bucket = \"b\"\naccess_key_id = \"AKIA-SECRET-ID\"");
    assert_mentions(
        &message,
        &["s3.secret_access_key", "default credential chain"],
    );
    assert_mentions(
        &e("bucket = \"b\"\nmax_concurrency = 0"),
        &["s3.max_concurrency", "1 to 1024"],
    );
    assert_mentions(&e("bucket = \"b\"\ntimeout_ms = 0"), &["s3.timeout_ms"]);
    assert_mentions(
        &e("bucket = \"b\"\nretries = 99"),
        &["s3.retries", "0 to 20"],
    );
    assert_mentions(
        &e("bucket = \"b\"\nbukket = 1"),
        &["unknown field", "bukket"],
    );
    // A credential in the wrong form is never echoed.
    let message = e("bucket = \"b\"\nsecret_access_key = 12345");
    assert_mentions(&message, &["s3.secret_access_key", "<redacted>"]);
    assert!(!message.contains("12345"), "{message}");
    // No namespace anywhere.
    let message = Config::from_toml_str(&format!("{ONE_DEVICE}[s3]\nbucket = \"b\"\n"))
        .expect_err("no namespace")
        .to_string();
    assert_mentions(&message, &["s3.namespace", "[files.namespace]"]);
}

#[test]
fn the_example_s3_section_parses_when_uncommented() {
    let text = include_str!("../../kvtier.example.toml");
    let start = text.find("# [s3]\n").expect("example has an [s3] section");
    let mut section = String::new();
    for line in text[start..]
        .lines()
        .map(|l| l.strip_prefix("# ").unwrap_or(l))
        .filter(|l| {
            l.starts_with('[')
                || l.split_once(" = ").is_some_and(|(k, _)| {
                    !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                })
        })
    {
        section.push_str(line);
        section.push('\n');
    }
    let config =
        Config::from_toml_str(&format!("{ONE_DEVICE}{section}")).expect("uncommented [s3] section");
    let s3 = config.s3.expect("s3");
    assert_eq!(s3.bucket, "kv-cache");
    assert_eq!(s3.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
    assert_eq!(
        (s3.max_concurrency, s3.timeout_ms, s3.retries),
        (32, 5000, 3)
    );
    assert_eq!(s3.access_key_id.as_ref().map(Secret::expose), Some("..."));
    assert!(!format!("{s3:?}").contains("\"...\""));
}

/// A config of one device and a `[files]` section holding `lines` and a minimal namespace.
fn files(lines: &str) -> String {
    format!(
        "{ONE_DEVICE}[files]\n{lines}\n[files.namespace]\nmodel_name = \"f\"\n\
         dtype = \"x\"\ntokens_per_hash = 16\nblocks_per_file = 1\nkv_cache_groups = []\n"
    )
}

// Modes default to owner-only, parse from octal integers and strings, and every mistake names
// the field, the value and what is accepted.
#[test]
fn files_modes_parse_and_errors_name_field_value_and_accepted() {
    let modes = |lines: &str| {
        let c = Config::from_toml_str(&files(lines)).expect("valid [files]");
        let f = c.files.expect("files");
        (f.file_mode, f.dir_mode)
    };
    assert_eq!(modes(""), (0o600, 0o700));
    assert_eq!(
        modes("file_mode = 0o660\ndir_mode = \"0770\""),
        (0o660, 0o770)
    );
    assert_eq!(modes("file_mode = \"0o644\""), (0o644, 0o700));
    for (line, field, value) in [
        ("file_mode = 640", "files.file_mode", "640"),
        ("file_mode = 0o400", "files.file_mode", "256"),
        ("file_mode = 0o4600", "files.file_mode", "2432"),
        ("file_mode = \"rw-------\"", "files.file_mode", "rw-------"),
        ("dir_mode = 0o600", "files.dir_mode", "384"),
        ("dir_mode = true", "files.dir_mode", "true"),
    ] {
        assert_mentions(
            &error_of(&files(line)),
            &[field, value, "octal", "at most 0777"],
        );
    }
}

// The answers for blocks another process may have published: bounded and aged, defaults
// 65536 and 1000 ms; nonsense names the field.
#[test]
fn files_lookup_cache_parses_and_errors_name_field() {
    let cache = |lines: &str| {
        let f = Config::from_toml_str(&files(lines))
            .expect("valid [files]")
            .files
            .expect("files");
        (f.lookup_cache_max, f.lookup_ttl_ms)
    };
    assert_eq!(cache(""), (65536, 1000));
    let first = |lines: &str| {
        Config::from_toml_str(&files(lines))
            .expect("valid [files]")
            .files
            .expect("files")
            .first_lookup
    };
    assert_eq!(first(""), FirstLookup::Miss);
    assert_eq!(first("first_lookup = \"pending\""), FirstLookup::Pending);
    assert_mentions(
        &error_of(&files("first_lookup = \"retry\"")),
        &["files.first_lookup", "retry", "\"miss\"", "\"pending\""],
    );
    assert_eq!(cache("lookup_cache_max = 8\nlookup_ttl_ms = 0"), (8, 0));
    let parsed = |lines: &str| {
        Config::from_toml_str(&files(lines))
            .expect("valid [files]")
            .files
            .expect("files")
    };
    assert_eq!(parsed("").io_wq_workers, 32);
    assert_eq!(parsed("io_wq_workers = 1").io_wq_workers, 1);
    assert_eq!(parsed("io_wq_workers = 1024").io_wq_workers, 1024);
    assert_eq!(
        parsed("").stores_opening,
        FilesConfig::DEFAULT_STORES_OPENING
    );
    assert_eq!(parsed("stores_opening = 1").stores_opening, 1);
    assert_eq!(parsed("stores_opening = 4096").stores_opening, 4096);
    for (line, field, value) in [
        ("lookup_cache_max = 0", "files.lookup_cache_max", "0"),
        ("lookup_cache_max = -1", "files.lookup_cache_max", "-1"),
        ("lookup_ttl_ms = \"1s\"", "files.lookup_ttl_ms", "1s"),
        ("io_wq_workers = 0", "files.io_wq_workers", "0"),
        ("io_wq_workers = 1025", "files.io_wq_workers", "1025"),
        ("io_wq_workers = -3", "files.io_wq_workers", "-3"),
        ("io_wq_workers = \"many\"", "files.io_wq_workers", "many"),
        ("stores_opening = 0", "files.stores_opening", "0"),
        ("stores_opening = 4097", "files.stores_opening", "4097"),
        ("stores_opening = 2.5", "files.stores_opening", "2.5"),
    ] {
        assert_mentions(&error_of(&files(line)), &[field, value]);
    }
}

#[test]
fn io_timeout_is_checked() {
    let c = Config::from_toml_str(&format!("io_timeout_ms = 250\n{ONE_DEVICE}")).expect("valid");
    assert_eq!(c.io_timeout_ms, 250);
    for (value, shown) in [
        ("0", "0"),
        ("5", "5"),
        ("3600001", "3600001"),
        ("\"10s\"", "10s"),
    ] {
        assert_mentions(
            &error_with_device(&format!("io_timeout_ms = {value}")),
            &["io_timeout_ms", shown, "10 to 3600000"],
        );
    }
}

#[test]
fn verify_loads_is_recovered_or_always() {
    let c =
        Config::from_toml_str(&format!("verify_loads = \"always\"\n{ONE_DEVICE}")).expect("valid");
    assert_eq!(c.verify_loads, VerifyLoads::Always);
    assert_eq!(Config::default().verify_loads, VerifyLoads::Recovered);
    let message = Config::from_toml_str(&format!("verify_loads = \"sometimes\"\n{ONE_DEVICE}"))
        .expect_err("not a choice")
        .to_string();
    assert_mentions(
        &message,
        &["`verify_loads`", "sometimes", "\"recovered\"", "\"always\""],
    );
}

// A VFIO device is named by its controller's PCI address; its path is derived from it, and
// what cannot be meant (a path too, another kind, an nsid elsewhere, mixed devices) is refused
// with the field named.
#[test]
fn vfio_devices() {
    let config = Config::from_toml_str("[[devices]]\npci = \"0000:01:00.0\"\nnsid = 2\n")
        .expect("a vfio device");
    let d = &config.devices[0];
    assert_eq!(d.kind, DeviceKind::Vfio);
    assert_eq!(d.pci.as_deref(), Some("0000:01:00.0"));
    assert_eq!(d.nsid, 2);
    assert_eq!(d.path, Path::new("vfio:0000:01:00.0"));
    assert_eq!(d, &{
        let mut v = DeviceConfig::vfio("0000:01:00.0", 2);
        v.kind = DeviceKind::Vfio;
        v
    });
    // Printed and read back: the same device.
    let text = config.to_toml_string();
    assert!(
        text.contains("pci = \"0000:01:00.0\"") && text.contains("nsid = 2"),
        "{text}"
    );
    assert_eq!(Config::from_toml_str(&text).expect("printed"), config);

    let message = error_of("[[devices]]\npci = \"01:00.0\"\n");
    assert_mentions(
        &message,
        &["`devices[0].pci`", "\"01:00.0\"", "DDDD:BB:DD.F"],
    );
    let message = error_of("[[devices]]\nkind = \"vfio\"\n");
    assert_mentions(&message, &["`devices[0].pci`", "(missing)"]);
    let message = error_of("[[devices]]\npci = \"0000:01:00.0\"\npath = \"/dev/ng0n1\"\n");
    assert_mentions(
        &message,
        &["`devices[0].path`", "\"/dev/ng0n1\"", "no path with pci"],
    );
    let message = error_of("[[devices]]\npci = \"0000:01:00.0\"\nkind = \"nvme\"\n");
    assert_mentions(&message, &["`devices[0].kind`", "\"nvme\"", "\"vfio\""]);
    let message = error_of(&format!("{ONE_DEVICE}nsid = 2\n"));
    assert_mentions(&message, &["`devices[0].nsid`", "2", "kind = \"vfio\""]);
    let message = error_of("[[devices]]\npci = \"0000:01:00.0\"\nnsid = 0\n");
    assert_mentions(&message, &["`devices[0].nsid`", "0", "from 1"]);
    let message = error_of(&format!(
        "[[devices]]\npci = \"0000:01:00.0\"\n{ONE_DEVICE}"
    ));
    assert_mentions(
        &message,
        &["`devices[1].kind`", "\"auto\"", "\"vfio\", like devices[0]"],
    );
    let message = error_of("[[devices]]\npci = \"0000:01:00.0\"\nlayout = \"files\"\n");
    assert_mentions(&message, &["`devices[0].kind`", "\"vfio\""]);
}
