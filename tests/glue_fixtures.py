"""Small GLUE directories for tests, written in the real file formats with their real quirks.

Quirks reproduced: CoLA has no header; MRPC starts with a UTF-8 byte-order mark and has unbalanced
`"` characters; SST-2 sentences end with a space; STS-B scores are written '5.000' and '0'; MNLI
train has 12 columns and its dev files 16, with gold_label differing from label1 in one row (the
reader must use gold_label); QNLI's text columns are 'question' and 'sentence'. Some files end with
blank lines.

`EXPECTED` is written out by hand (texts stripped, labels as indices) rather than derived from the
rows, so a test comparing against it checks the reader, not this module.
"""

from __future__ import annotations

from pathlib import Path

BOM = "\ufeff"

MNLI_TRAIN_HEADER = [
    "index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
    "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label",
]
MNLI_DEV_HEADER = MNLI_TRAIN_HEADER[:-1] + ["label2", "label3", "label4", "label5", "gold_label"]


def _mnli_row(i: int, genre: str, s1: str, s2: str, votes: list[str], gold: str) -> list[str]:
    """An MNLI row: parse columns are filler, `votes` is label1 (train) or label1..label5 (dev)."""
    parses = [f"( {s1} )", f"( {s2} )", f"(ROOT {s1})", f"(ROOT {s2})"]
    return [str(i), str(1000 + i), f"{1000 + i}e", genre, *parses, s1, s2, *votes, gold]


# task folder -> file name -> (header or None, rows, text before the header, text after the rows)
FILES: dict[str, dict[str, tuple[list[str] | None, list[list[str]], str, str]]] = {
    "CoLA": {
        "train.tsv": (None, [
            ["gj04", "1", "", "Our friends won't buy this analysis, let alone the next one we propose."],
            ["gj04", "0", "*", "They drank the pub."],
            ["cj99", "1", "", 'He said "hello" to me.'],
        ], "", ""),
        "dev.tsv": (None, [
            ["bc01", "1", "", "The sailors rode the breeze clear of the rocks."],
            ["bc01", "0", "*", "The more we study verbs, the crazier they get get."],
        ], "", ""),
    },
    "SST-2": {
        "train.tsv": (["sentence", "label"], [
            ["hide new secretions from the parental units ", "0"],
            ["contains no wit , only labored gags ", "0"],
            ["that loves its characters and communicates something rather beautiful about human nature ", "1"],
        ], "", ""),
        "dev.tsv": (["sentence", "label"], [
            ["it 's a charming and often affecting journey . ", "1"],
            ["unflinchingly bleak and desperate ", "0"],
        ], "", ""),
    },
    "MRPC": {
        "train.tsv": (["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"], [
            ["1", "702876", "702977",
             'Amrozi accused his brother , whom he called " the witness " , of deliberately distorting his evidence .',
             'Referring to him as only " the witness " , Amrozi accused his brother of deliberately distorting his evidence .'],
            ["0", "2108705", "2108831",
             "Yucaipa owned Dominick 's before selling the chain to Safeway in 1998 for $ 2.5 billion .",
             "Yucaipa bought Dominick 's in 1995 for $ 693 million and sold it to Safeway for $ 1.8 billion in 1998 ."],
            ["1", "1330381", "1330521",
             'He said the " tough " stance was needed .',
             'The " tough stance was needed , he said .'],
        ], BOM, ""),
        "dev.tsv": (["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"], [
            ["1", "1355540", "1355592",
             "He said the foodservice pie business doesn 't fit the company 's long-term growth strategy .",
             '" The foodservice pie business does not fit our long-term growth strategy .'],
            ["0", "2029631", "2029565",
             "Magnarelli said Racicot hated the Iraqi regime and looked forward to using his long years of training in the war .",
             'His wife said he was " 100 percent behind George Bush " and looked forward to using his years of training in the war .'],
        ], BOM, ""),
    },
    "STS-B": {
        "train.tsv": (["index", "genre", "filename", "year", "old_index", "source1", "source2",
                       "sentence1", "sentence2", "score"], [
            ["0", "main-captions", "MSRvid", "2012test", "0001", "none", "none",
             "A plane is taking off.", "An air plane is taking off.", "5.000"],
            ["1", "main-captions", "MSRvid", "2012test", "0004", "none", "none",
             "A man is playing a large flute.", "A man is playing a flute.", "3.800"],
            ["2", "main-news", "headlines", "2016", "1470", "Europe Media Monitor (http://emm.newsbrief.eu)",
             "Europe Media Monitor (http://emm.newsbrief.eu)",
             "China, India vow to further bilateral ties", "China Scrambles to Reassure Jittery Stock Traders", "0"],
        ], "", ""),
        "dev.tsv": (["index", "genre", "filename", "year", "old_index", "source1", "source2",
                     "sentence1", "sentence2", "score"], [
            ["0", "main-captions", "MSRvid", "2012test", "0000", "none", "none",
             "A man with a hard hat is dancing.", "A man wearing a hard hat is dancing.", "5.000"],
            ["1", "main-captions", "MSRvid", "2012test", "0002", "none", "none",
             "A young child is riding a horse.", "A child is riding a horse.", "4.750"],
        ], "", "\n"),
    },
    "QQP": {
        "train.tsv": (["id", "qid1", "qid2", "question1", "question2", "is_duplicate"], [
            ["133273", "213221", "213222", "How is the life of a math student? Could you describe your own experiences?",
             "Which level of prepration is enough for the exam jlpt5?", "0"],
            ["402555", "536040", "536041", "How do I control my horny emotions?", "How do you control your horniness?", "1"],
            ["360472", "364011", "490273", 'What does "rainbow" mean?', "What causes a rainbow?", "0"],
        ], "", ""),
        "dev.tsv": (["id", "qid1", "qid2", "question1", "question2", "is_duplicate"], [
            ["201359", "303345", "303346", "Why are African-Americans so beautiful?", "Why are hispanics so beautiful?", "0"],
            ["263843", "69383", "380476", "I want to pursue PhD in Computer Science about social network,what is the open problem in social networks?",
             "I handle social media for a non-profit. Should I start going to social media networking events? Are there any good ones in the bay area?", "0"],
        ], "", ""),
    },
    "MNLI": {
        "train.tsv": (MNLI_TRAIN_HEADER, [
            _mnli_row(0, "government", "Conceptually cream skimming has two basic dimensions - product and geography.",
                      "Product and geography are what make cream skimming work. ", ["neutral"], "neutral"),
            _mnli_row(1, "telephone", "you know during the season and i guess at at your level uh you lose them to the next level",
                      "You lose the things to the following level if the people recall.", ["entailment"], "entailment"),
            _mnli_row(2, "fiction", 'He said, "Go away."', "He welcomed them in.", ["contradiction"], "contradiction"),
        ], "", ""),
        "dev_matched.tsv": (MNLI_DEV_HEADER, [
            _mnli_row(0, "government", "The new rights are nice enough", "Everyone really likes the newest benefits ",
                      ["neutral", "entailment", "neutral", "neutral", "neutral"], "neutral"),
            _mnli_row(1, "government", "This site includes a list of all award winners.",
                      "The Government Executive articles housed on the website are not able to be searched.",
                      ["entailment", "contradiction", "contradiction", "contradiction", "contradiction"], "contradiction"),
        ], "", ""),
        "dev_mismatched.tsv": (MNLI_DEV_HEADER, [
            _mnli_row(0, "letters", "Your contribution helped make it possible for us to provide our students with a quality education.",
                      "Your contributions were of no help with our students' education.",
                      ["contradiction", "contradiction", "contradiction", "contradiction", "contradiction"], "contradiction"),
            _mnli_row(1, "verbatim", "The answer is yes.", "The answer is not no.",
                      ["entailment", "entailment", "neutral", "entailment", "entailment"], "entailment"),
        ], "", ""),
    },
    "QNLI": {
        "train.tsv": (["index", "question", "sentence", "label"], [
            ["0", "When did the third Digimon series begin?",
             "Unlike the two seasons before it and most of the seasons that followed, Digimon Tamers takes a darker approach.",
             "not_entailment"],
            ["1", "Which missile batteries often have individual launchers several kilometres from one another?",
             "When MANPADS is operated by specialists, batteries may have several dozen teams deploying separately in small sections.",
             "not_entailment"],
            ["2", "What two things does Popper argue Tarski's theory involves in an evaluation of truth?",
             "He bases this interpretation on the fact that examples such as the one described above refer to two things.",
             "entailment"],
        ], "", ""),
        "dev.tsv": (["index", "question", "sentence", "label"], [
            ["0", "What came into force after the new constitution was herald?",
             "As of that day, the new constitution heralding the Second Republic came into force.", "entailment"],
            ["1", "What is the first major city in the stream of the Rhine?",
             "The most important tributaries in this area are the Ill below of Strasbourg.", "not_entailment"],
        ], "", "\n\n"),
    },
    "RTE": {
        "train.tsv": (["index", "sentence1", "sentence2", "label"], [
            ["0", "No Weapons of Mass Destruction Found in Iraq Yet.", "Weapons of Mass Destruction Found in Iraq.",
             "not_entailment"],
            ["1", "A place of sorrow, after Pope John Paul II died, became a place of celebration.",
             "Pope Benedict XVI is the new leader of the Roman Catholic Church.", "entailment"],
            ["2", 'Herceptin was already approved to treat the sickest breast cancer patients. ',
             "Herceptin can be used to treat breast cancer.", "entailment"],
        ], "", ""),
        "dev.tsv": (["index", "sentence1", "sentence2", "label"], [
            ["0", "Dana Reeve, the widow of the actor Christopher Reeve, has died of lung cancer at age 44.",
             "Christopher Reeve had an accident.", "not_entailment"],
            ["1", "Yet, we now are discovering that antibiotics are losing their effectiveness.",
             "Bacteria is winning the war against antibiotics.", "entailment"],
        ], "", ""),
    },
    "WNLI": {
        "train.tsv": (["index", "sentence1", "sentence2", "label"], [
            ["0", "I stuck a pin through a carrot. When I pulled the pin out, it had a hole.", "The carrot had a hole.", "1"],
            ["1", "John couldn't see the stage with Billy in front of him because he is so short.", "John is so short.", "1"],
            ["2", "The police arrested all of the gang members. They were trying to stop the drug trade in the neighborhood.",
             "The police were trying to stop the drug trade in the neighborhood.", "1"],
        ], "", ""),
        "dev.tsv": (["index", "sentence1", "sentence2", "label"], [
            ["0", "The drain is clogged with hair. It has to be cleaned.", "The hair has to be cleaned.", "0"],
            ["1", "Jane knocked on Susan's door but she did not answer.", "Susan did not answer.", "1"],
        ], "", ""),
    },
}

# task name -> split -> [(text_a, text_b, label)], written by hand.
EXPECTED: dict[str, dict[str, list[tuple]]] = {
    "cola": {
        "train": [("Our friends won't buy this analysis, let alone the next one we propose.", None, 1),
                  ("They drank the pub.", None, 0),
                  ('He said "hello" to me.', None, 1)],
        "dev": [("The sailors rode the breeze clear of the rocks.", None, 1),
                ("The more we study verbs, the crazier they get get.", None, 0)],
    },
    "sst-2": {
        "train": [("hide new secretions from the parental units", None, 0),
                  ("contains no wit , only labored gags", None, 0),
                  ("that loves its characters and communicates something rather beautiful about human nature", None, 1)],
        "dev": [("it 's a charming and often affecting journey .", None, 1),
                ("unflinchingly bleak and desperate", None, 0)],
    },
    "mrpc": {
        "train": [('Amrozi accused his brother , whom he called " the witness " , of deliberately distorting his evidence .',
                   'Referring to him as only " the witness " , Amrozi accused his brother of deliberately distorting his evidence .', 1),
                  ("Yucaipa owned Dominick 's before selling the chain to Safeway in 1998 for $ 2.5 billion .",
                   "Yucaipa bought Dominick 's in 1995 for $ 693 million and sold it to Safeway for $ 1.8 billion in 1998 .", 0),
                  ('He said the " tough " stance was needed .', 'The " tough stance was needed , he said .', 1)],
        "dev": [("He said the foodservice pie business doesn 't fit the company 's long-term growth strategy .",
                 '" The foodservice pie business does not fit our long-term growth strategy .', 1),
                ("Magnarelli said Racicot hated the Iraqi regime and looked forward to using his long years of training in the war .",
                 'His wife said he was " 100 percent behind George Bush " and looked forward to using his years of training in the war .', 0)],
    },
    "sts-b": {
        "train": [("A plane is taking off.", "An air plane is taking off.", 5.0),
                  ("A man is playing a large flute.", "A man is playing a flute.", 3.8),
                  ("China, India vow to further bilateral ties", "China Scrambles to Reassure Jittery Stock Traders", 0.0)],
        "dev": [("A man with a hard hat is dancing.", "A man wearing a hard hat is dancing.", 5.0),
                ("A young child is riding a horse.", "A child is riding a horse.", 4.75)],
    },
    "qqp": {
        "train": [("How is the life of a math student? Could you describe your own experiences?",
                   "Which level of prepration is enough for the exam jlpt5?", 0),
                  ("How do I control my horny emotions?", "How do you control your horniness?", 1),
                  ('What does "rainbow" mean?', "What causes a rainbow?", 0)],
        "dev": [("Why are African-Americans so beautiful?", "Why are hispanics so beautiful?", 0),
                ("I want to pursue PhD in Computer Science about social network,what is the open problem in social networks?",
                 "I handle social media for a non-profit. Should I start going to social media networking events? Are there any good ones in the bay area?", 0)],
    },
    "mnli": {
        "train": [("Conceptually cream skimming has two basic dimensions - product and geography.",
                   "Product and geography are what make cream skimming work.", 2),
                  ("you know during the season and i guess at at your level uh you lose them to the next level",
                   "You lose the things to the following level if the people recall.", 1),
                  ('He said, "Go away."', "He welcomed them in.", 0)],
        "dev_matched": [("The new rights are nice enough", "Everyone really likes the newest benefits", 2),
                        ("This site includes a list of all award winners.",
                         "The Government Executive articles housed on the website are not able to be searched.", 0)],
        "dev_mismatched": [("Your contribution helped make it possible for us to provide our students with a quality education.",
                            "Your contributions were of no help with our students' education.", 0),
                           ("The answer is yes.", "The answer is not no.", 1)],
    },
    "qnli": {
        "train": [("When did the third Digimon series begin?",
                   "Unlike the two seasons before it and most of the seasons that followed, Digimon Tamers takes a darker approach.", 1),
                  ("Which missile batteries often have individual launchers several kilometres from one another?",
                   "When MANPADS is operated by specialists, batteries may have several dozen teams deploying separately in small sections.", 1),
                  ("What two things does Popper argue Tarski's theory involves in an evaluation of truth?",
                   "He bases this interpretation on the fact that examples such as the one described above refer to two things.", 0)],
        "dev": [("What came into force after the new constitution was herald?",
                 "As of that day, the new constitution heralding the Second Republic came into force.", 0),
                ("What is the first major city in the stream of the Rhine?",
                 "The most important tributaries in this area are the Ill below of Strasbourg.", 1)],
    },
    "rte": {
        "train": [("No Weapons of Mass Destruction Found in Iraq Yet.", "Weapons of Mass Destruction Found in Iraq.", 1),
                  ("A place of sorrow, after Pope John Paul II died, became a place of celebration.",
                   "Pope Benedict XVI is the new leader of the Roman Catholic Church.", 0),
                  ("Herceptin was already approved to treat the sickest breast cancer patients.",
                   "Herceptin can be used to treat breast cancer.", 0)],
        "dev": [("Dana Reeve, the widow of the actor Christopher Reeve, has died of lung cancer at age 44.",
                 "Christopher Reeve had an accident.", 1),
                ("Yet, we now are discovering that antibiotics are losing their effectiveness.",
                 "Bacteria is winning the war against antibiotics.", 0)],
    },
    "wnli": {
        "train": [("I stuck a pin through a carrot. When I pulled the pin out, it had a hole.", "The carrot had a hole.", 1),
                  ("John couldn't see the stage with Billy in front of him because he is so short.", "John is so short.", 1),
                  ("The police arrested all of the gang members. They were trying to stop the drug trade in the neighborhood.",
                   "The police were trying to stop the drug trade in the neighborhood.", 1)],
        "dev": [("The drain is clogged with hair. It has to be cleaned.", "The hair has to be cleaned.", 0),
                ("Jane knocked on Susan's door but she did not answer.", "Susan did not answer.", 1)],
    },
}


def tsv_text(header: list[str] | None, rows: list[list[str]], prefix: str = "", suffix: str = "") -> str:
    """A GLUE file's text: optional header, one tab-joined line per row, '\\n' line endings."""
    lines = ([header] if header is not None else []) + rows
    return prefix + "".join("\t".join(fields) + "\n" for fields in lines) + suffix


def write_glue_dir(root: str | Path, folders: list[str] | None = None) -> Path:
    """Write the fixture files (all task folders, or only `folders`) under `root`; returns root."""
    root = Path(root)
    for folder, files in FILES.items():
        if folders is not None and folder not in folders:
            continue
        (root / folder).mkdir(parents=True, exist_ok=True)
        for name, (header, rows, prefix, suffix) in files.items():
            (root / folder / name).write_text(tsv_text(header, rows, prefix, suffix), encoding="utf-8", newline="")
    return root


def replace_line(path: str | Path, number: int, text: str) -> None:
    """Overwrite 1-based line `number` of `path` with `text` (the rest of the file unchanged)."""
    path = Path(path)
    lines = path.read_bytes().decode("utf-8").split("\n")
    lines[number - 1] = text
    path.write_bytes("\n".join(lines).encode("utf-8"))


def read_line(path: str | Path, number: int) -> str:
    """1-based line `number` of `path`, without its line ending (BOM kept, as in the file)."""
    return Path(path).read_bytes().decode("utf-8").split("\n")[number - 1]
