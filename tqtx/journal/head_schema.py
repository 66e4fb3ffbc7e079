"""The head schema of each journal chain as plain SQL: what ``create_all`` of
:mod:`tqtx.journal.models` emits (tables in dependency order, each followed by its indexes)
plus alembic's version table, regenerated in place by ``python -m
tqtx.journal.head_schema``. A test checks it against the models, and the migrated schema
against it, so a model change without regenerating this file fails the suite. Kept as constants so that creating a new
journal imports neither the ORM nor the SQL compiler (~90 ms per controller start)."""

from pathlib import Path

HEAD_SCHEMA_SQL = {'controller': ('\n'
                'CREATE TABLE incarnations (\n'
                '\tid INTEGER NOT NULL, \n'
                '\tstarted_at VARCHAR(40) NOT NULL, \n'
                '\tpid INTEGER NOT NULL, \n'
                '\thost VARCHAR(255) NOT NULL, \n'
                '\taddress VARCHAR(255) NOT NULL, \n'
                '\tversion VARCHAR(64) NOT NULL, \n'
                '\tstate_dir TEXT NOT NULL, \n'
                '\tended_at VARCHAR(40), \n'
                '\tCONSTRAINT pk_incarnations PRIMARY KEY (id)\n'
                ')\n'
                '\n',
                '\n'
                'CREATE TABLE meta_blobs (\n'
                '\tname VARCHAR(32) NOT NULL, \n'
                '\tvalue BLOB NOT NULL, \n'
                '\tCONSTRAINT pk_meta_blobs PRIMARY KEY (name)\n'
                ')\n'
                '\n',
                '\n'
                'CREATE TABLE meta_counters (\n'
                '\tname VARCHAR(32) NOT NULL, \n'
                '\tvalue BIGINT NOT NULL, \n'
                '\tCONSTRAINT pk_meta_counters PRIMARY KEY (name)\n'
                ')\n'
                '\n',
                '\n'
                'CREATE TABLE meta_keys (\n'
                '\tpartition_id TEXT NOT NULL, \n'
                '\t"key" TEXT NOT NULL, \n'
                '\tglobal_index INTEGER NOT NULL, \n'
                "\tfields TEXT DEFAULT '[]' NOT NULL, \n"
                '\ttag BLOB NOT NULL, \n'
                '\tlost_unit INTEGER, \n'
                '\tgen BIGINT, \n'
                '\tCONSTRAINT pk_meta_keys PRIMARY KEY (partition_id, "key"), \n'
                '\tCONSTRAINT uq_meta_keys_global_index UNIQUE (global_index)\n'
                ')\n'
                ' WITHOUT ROWID\n'
                '\n',
                '\n'
                'CREATE TABLE meta_markers (\n'
                '\tname VARCHAR(32) NOT NULL, \n'
                '\tvalue TEXT NOT NULL, \n'
                '\tCONSTRAINT pk_meta_markers PRIMARY KEY (name)\n'
                ')\n'
                '\n',
                '\n'
                'CREATE TABLE meta_requests (\n'
                '\tseq INTEGER NOT NULL, \n'
                '\trequest_id VARCHAR(64) NOT NULL, \n'
                '\treply BLOB NOT NULL, \n'
                '\tCONSTRAINT pk_meta_requests PRIMARY KEY (seq)\n'
                ')\n'
                '\n',
                '\n'
                'CREATE TABLE meta_schemas (\n'
                '\tpartition_id TEXT NOT NULL, \n'
                '\tfield TEXT NOT NULL, \n'
                '\tschema TEXT NOT NULL, \n'
                '\tCONSTRAINT pk_meta_schemas PRIMARY KEY (partition_id, field)\n'
                ')\n'
                '\n',
                '\n'
                'CREATE TABLE dumps (\n'
                '\tdump_id VARCHAR(64) NOT NULL, \n'
                '\tdump_dir TEXT NOT NULL, \n'
                '\tpartition_id VARCHAR(255) NOT NULL, \n'
                "\tkeys INTEGER DEFAULT '0' NOT NULL, \n"
                "\trows_with_data INTEGER DEFAULT '0' NOT NULL, \n"
                "\tbytes BIGINT DEFAULT '0' NOT NULL, \n"
                "\tshards INTEGER DEFAULT '0' NOT NULL, \n"
                '\tincarnation_id INTEGER, \n'
                '\tcreated_at VARCHAR(40) NOT NULL, \n'
                '\tCONSTRAINT pk_dumps PRIMARY KEY (dump_id), \n'
                '\tCONSTRAINT fk_dumps_incarnation_id_incarnations FOREIGN KEY(incarnation_id) '
                'REFERENCES incarnations (id)\n'
                ')\n'
                '\n',
                '\n'
                'CREATE TABLE recovery_events (\n'
                '\tid INTEGER NOT NULL, \n'
                '\tincarnation_id INTEGER, \n'
                '\tat VARCHAR(40) NOT NULL, \n'
                '\tkind VARCHAR(16) NOT NULL, \n'
                '\ttarget TEXT NOT NULL, \n'
                '\taction VARCHAR(64) NOT NULL, \n'
                "\tdetail TEXT DEFAULT '' NOT NULL, \n"
                '\tCONSTRAINT pk_recovery_events PRIMARY KEY (id), \n'
                "\tCONSTRAINT ck_recovery_events_kind CHECK (kind IN ('restore', 'publication', "
                "'buffer')), \n"
                '\tCONSTRAINT fk_recovery_events_incarnation_id_incarnations FOREIGN '
                'KEY(incarnation_id) REFERENCES incarnations (id)\n'
                ')\n'
                '\n',
                '\n'
                'CREATE TABLE restores (\n'
                '\trestore_id VARCHAR(64) NOT NULL, \n'
                '\tpartition_id VARCHAR(255) NOT NULL, \n'
                '\tdump_dir TEXT NOT NULL, \n'
                '\tdump_id VARCHAR(64), \n'
                '\tincarnation_id INTEGER NOT NULL, \n'
                '\tstate VARCHAR(16) NOT NULL, \n'
                '\toutcome VARCHAR(16), \n'
                '\treason TEXT, \n'
                "\tkeys INTEGER DEFAULT '0' NOT NULL, \n"
                "\trows INTEGER DEFAULT '0' NOT NULL, \n"
                "\tbytes BIGINT DEFAULT '0' NOT NULL, \n"
                '\tcreated_at VARCHAR(40) NOT NULL, \n'
                '\tupdated_at VARCHAR(40) NOT NULL, \n'
                '\tfinished_at VARCHAR(40), \n'
                '\t"plan" BLOB, \n'
                '\tCONSTRAINT pk_restores PRIMARY KEY (restore_id), \n'
                "\tCONSTRAINT ck_restores_state CHECK (state IN ('active', 'committing', "
                "'committed', 'aborted', 'cancelled', 'failed')), \n"
                '\tCONSTRAINT fk_restores_incarnation_id_incarnations FOREIGN KEY(incarnation_id) '
                'REFERENCES incarnations (id)\n'
                ')\n'
                '\n',
                'CREATE INDEX ix_restores_state ON restores (state)',
                '\n'
                'CREATE TABLE restore_units (\n'
                '\tid INTEGER NOT NULL, \n'
                '\trestore_id VARCHAR(64) NOT NULL, \n'
                '\tunit_id INTEGER NOT NULL, \n'
                '\tstate VARCHAR(16) NOT NULL, \n'
                "\trows INTEGER DEFAULT '0' NOT NULL, \n"
                "\tbytes BIGINT DEFAULT '0' NOT NULL, \n"
                '\terror TEXT, \n'
                '\tcreated_at VARCHAR(40) NOT NULL, \n'
                '\tupdated_at VARCHAR(40) NOT NULL, \n'
                '\tCONSTRAINT pk_restore_units PRIMARY KEY (id), \n'
                '\tCONSTRAINT uq_restore_units_restore_id_unit_id UNIQUE (restore_id, unit_id), \n'
                "\tCONSTRAINT ck_restore_units_state CHECK (state IN ('pending', 'claimed', "
                "'staged', 'applied', 'failed', 'dropped')), \n"
                '\tCONSTRAINT fk_restore_units_restore_id_restores FOREIGN KEY(restore_id) '
                'REFERENCES restores (restore_id)\n'
                ')\n'
                '\n',
                'CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL, CONSTRAINT '
                'alembic_version_pkc PRIMARY KEY (version_num))'),
 'dump': ('\n'
          'CREATE TABLE publications (\n'
          '\tattempt_id VARCHAR(64) NOT NULL, \n'
          '\tkind VARCHAR(16) NOT NULL, \n'
          '\tdump_id VARCHAR(64), \n'
          '\tstaging_dir TEXT NOT NULL, \n'
          '\tphase VARCHAR(16) NOT NULL, \n'
          '\terror TEXT, \n'
          '\tcreated_at VARCHAR(40) NOT NULL, \n'
          '\tupdated_at VARCHAR(40) NOT NULL, \n'
          '\tCONSTRAINT pk_publications PRIMARY KEY (attempt_id), \n'
          "\tCONSTRAINT ck_publications_phase CHECK (phase IN ('staging', 'written', 'synced', "
          "'old-moved', 'published', 'cleaned', 'failed', 'rolled-back')), \n"
          "\tCONSTRAINT ck_publications_kind CHECK (kind IN ('dump', 'checkpoint'))\n"
          ')\n'
          '\n',
          'CREATE INDEX ix_publications_phase ON publications (phase)',
          '\n'
          'CREATE TABLE restores (\n'
          '\trestore_id VARCHAR(64) NOT NULL, \n'
          '\tcontroller_address VARCHAR(255) NOT NULL, \n'
          '\tincarnation_id INTEGER, \n'
          '\tcontroller_state_dir TEXT, \n'
          '\tpartition_id VARCHAR(255) NOT NULL, \n'
          '\tstate VARCHAR(16) NOT NULL, \n'
          '\tcreated_at VARCHAR(40) NOT NULL, \n'
          '\tupdated_at VARCHAR(40) NOT NULL, \n'
          '\tCONSTRAINT pk_restores PRIMARY KEY (restore_id), \n'
          "\tCONSTRAINT ck_restores_state CHECK (state IN ('reading', 'committed', 'aborted', "
          "'cancelled', 'failed'))\n"
          ')\n'
          '\n',
          'CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL, CONSTRAINT '
          'alembic_version_pkc PRIMARY KEY (version_num))')}


def compiled(chain: str) -> tuple[str, ...]:
    """The statements compiled from the models now (what HEAD_SCHEMA_SQL must equal)."""
    from sqlalchemy.dialects import sqlite
    from sqlalchemy.schema import CreateIndex, CreateTable

    from .migrate import _VERSION_TABLE, _metadata
    metadata = _metadata(chain)
    dialect = sqlite.dialect()
    out = []
    for table in metadata.sorted_tables:
        out.append(str(CreateTable(table).compile(dialect=dialect)))
        out.extend(str(CreateIndex(ix).compile(dialect=dialect))
                   for ix in sorted(table.indexes, key=lambda ix: ix.name or ""))
    return (*out, _VERSION_TABLE)


def write() -> None:
    """Rewrite :data:`HEAD_SCHEMA_SQL` in this file from the models."""
    import pprint
    path = Path(__file__)
    text = path.read_text()
    start = text.index("HEAD_SCHEMA_SQL = {")
    end = text.index("\n\n\ndef compiled(", start)  # the constant ends where this follows
    new = "HEAD_SCHEMA_SQL = " + pprint.pformat(
        {c: compiled(c) for c in ("controller", "dump")}, width=100, sort_dicts=False)
    path.write_text(text[:start] + new + text[end:])


if __name__ == "__main__":  # python -m tqtx.journal.head_schema: regenerate the constant
    write()
